//! A thread cache's hand-off at thread exit. The owner counts a class's allocations and
//! frees with loads and stores and publishes its net allocations on its slow paths (mark by
//! compare-and-swap, no lock); another thread publishes the same lane under the registry
//! lock (`lanes::publish_all`) and reads the totals there (`front_totals`); at exit the owner,
//! under that lock, publishes the rest with a plain load and store and moves its counts into
//! the orphan counters. Whatever the interleaving, every block is published once and
//! counted once: the totals a reader sees under the lock never exceed what was done, are
//! exact once the thread is gone, and the published figure ends exact.

use crate::counts::{
    move_counts, owner_add, take_unpublished, take_unpublished_exiting, unpublished,
};
use crate::model;
use crate::raw::WaitersFirst;
use loom::cell::UnsafeCell;
use loom::sync::Arc;
use loom::sync::atomic::Ordering::Relaxed;
use loom::sync::atomic::{AtomicU32, AtomicU64};
use loom::thread;

/// One class of one thread's lane.
struct Slot {
    allocations: AtomicU64,
    frees: AtomicU64,
    published: AtomicU32,
}

impl Slot {
    fn new() -> Self {
        Self {
            allocations: AtomicU64::new(0),
            frees: AtomicU64::new(0),
            published: AtomicU32::new(0),
        }
    }

    fn take_unpublished(&self) -> i32 {
        take_unpublished(&self.published, &self.allocations, &self.frees)
    }
}

/// The process: the registry (its lock, and whether each cache is still on its list), the
/// caches' slots, the orphan counters and the owner's shared live figure (in blocks).
struct World {
    registry: WaitersFirst,
    registered: Vec<UnsafeCell<bool>>,
    slots: Vec<Slot>,
    orphan_allocations: AtomicU64,
    orphan_frees: AtomicU64,
    live: AtomicU64,
}

impl World {
    fn new(threads: usize) -> Arc<Self> {
        Arc::new(Self {
            registry: WaitersFirst {
                state: AtomicU32::new(0),
            },
            registered: (0..threads).map(|_| UnsafeCell::new(true)).collect(),
            slots: (0..threads).map(|_| Slot::new()).collect(),
            orphan_allocations: AtomicU64::new(0),
            orphan_frees: AtomicU64::new(0),
            live: AtomicU64::new(0),
        })
    }

    fn publish(&self, blocks: i32) {
        if blocks != 0 {
            self.live.fetch_add(blocks as i64 as u64, Relaxed);
        }
    }

    fn live(&self) -> i64 {
        self.live.load(Relaxed) as i64
    }

    /// Thread `i`'s exit (`on_thread_exit` → `retire`): under the registry lock, publish the
    /// rest, move the counts to the orphans, leave the list.
    fn exit(&self, i: usize) {
        let slot = &self.slots[i];
        self.registry.lock();
        self.publish(take_unpublished_exiting(
            &slot.published,
            &slot.allocations,
            &slot.frees,
        ));
        move_counts(
            &slot.allocations,
            &slot.frees,
            &self.orphan_allocations,
            &self.orphan_frees,
        );
        // SAFETY: under the registry lock (loom checks it).
        self.registered[i].with_mut(|r| unsafe { *r = false });
        self.registry.unlock();
    }

    /// Another thread, under the registry lock: publishes the registered lanes (a budget's
    /// `publish_all`), then sums allocations and frees over them and the orphans (as
    /// `front_totals` does). Returns the sums and each registered lane's unpublished blocks
    /// as read before publishing.
    fn publish_and_sum(&self) -> (u64, u64, Vec<i32>) {
        self.registry.lock();
        let (mut allocations, mut frees, mut pending) = (0, 0, Vec::new());
        for (slot, registered) in self.slots.iter().zip(&self.registered) {
            // SAFETY: under the registry lock.
            if registered.with(|r| unsafe { *r }) {
                pending.push(unpublished(&slot.published, &slot.allocations, &slot.frees));
                self.publish(slot.take_unpublished());
                allocations += slot.allocations.load(Relaxed);
                frees += slot.frees.load(Relaxed);
            }
        }
        allocations += self.orphan_allocations.load(Relaxed);
        frees += self.orphan_frees.load(Relaxed);
        self.registry.unlock();
        (allocations, frees, pending)
    }
}

/// An owner allocates twice, publishes on its slow path, frees once, allocates again and
/// exits, while another thread publishes its lane and reads the totals under the lock.
#[test]
fn exit_hands_every_count_on_once() {
    model(|| {
        let world = World::new(1);
        let owner = {
            let w = Arc::clone(&world);
            thread::spawn(move || {
                let slot = &w.slots[0];
                owner_add(&slot.allocations);
                owner_add(&slot.allocations);
                w.publish(slot.take_unpublished());
                owner_add(&slot.frees);
                owner_add(&slot.allocations);
                w.exit(0);
            })
        };
        let (allocations, frees, pending) = world.publish_and_sum();
        // Never more than was done: nothing counted both in the lane and in the orphans.
        assert!(allocations <= 3 && frees <= 1, "{allocations} {frees}");
        if pending.is_empty() {
            // The owner was gone: everything is in the orphans, all of it published.
            assert_eq!((allocations, frees), (3, 1));
        } else {
            // Counts read after the mark (Acquire) are at least as new as the ones it was
            // set from: past a mark of 2, one free at most. (3: frees read before the free,
            // allocations after the third allocation, a net no single moment had; the
            // mark then runs one ahead until the exit publishes the -1.)
            assert!((-1..=3).contains(&pending[0]), "{pending:?}");
        }
        owner.join().unwrap();
        assert_eq!(world.live(), 2, "every net block published once");
        assert_eq!(world.orphan_allocations.load(Relaxed), 3);
        assert_eq!(world.orphan_frees.load(Relaxed), 1);
        let slot = &world.slots[0];
        assert_eq!(slot.allocations.load(Relaxed) | slot.frees.load(Relaxed), 0);
    });
}

/// Two threads exit, one of them reading the totals under the lock before its own exit
/// (three threads waiting on the registry lock are beyond loom's branch limit: each waiter's
/// yield lets the other run, so their spins can alternate without end): each count lands
/// in the orphans once, and the reader never sees one both in a lane and in the orphans.
#[test]
fn two_exits_count_every_block_once() {
    model(|| {
        let world = World::new(2);
        let other = {
            let w = Arc::clone(&world);
            thread::spawn(move || {
                owner_add(&w.slots[1].allocations);
                w.exit(1);
            })
        };
        let slot = &world.slots[0];
        owner_add(&slot.allocations);
        owner_add(&slot.frees);
        let (allocations, frees, pending) = world.publish_and_sum();
        assert!(allocations <= 2 && frees == 1, "{allocations} {frees}");
        if pending.len() == 1 {
            // The other thread was gone: its allocation is in the orphans.
            assert_eq!(allocations, 2);
        }
        world.exit(0);
        other.join().unwrap();
        assert_eq!(world.live(), 1);
        assert_eq!(world.orphan_allocations.load(Relaxed), 2);
        assert_eq!(world.orphan_frees.load(Relaxed), 1);
    });
}
