//! Lanes made on demand: a thread's lanes of the tags past the ones built into every cache.
//!
//! A thread's first call of such a tag (an allocation in its scope, a free of one of its
//! blocks, a call through its handle) makes the lane, from a pool shared by all threads; the
//! lane goes back to the pool when the thread exits. The thread finds its lanes through a
//! two-level table indexed by tag (16 pointers in the cache, and a table of 256 for each
//! range of tags the thread uses), and the registry walks them through a list.
//!
//! The pool is part of the thread registry's list ([`ThreadList`]): lanes are made and given
//! back under its lock, which the `fork()` handlers hold, so a forked child never finds the
//! pool half changed.

use super::{HOOKS_UNREGISTERED, Lane, ThreadList};
use crate::os::{OsAllocator, PageSource};
use crate::schema::hpha::{MAX_TAGS, Tag};
use core::cell::Cell;
use core::ptr::{self, null_mut};
use core::sync::atomic::{AtomicPtr, Ordering::*};

/// Tags per table.
const PER_TABLE: usize = 256;
/// Tables a thread may have.
const TABLES: usize = MAX_TAGS / PER_TABLE;
/// Bytes mapped at once when the pool runs out of lanes or tables.
const SLAB: usize = 64 * 1024;

/// One range of tags' lanes of a thread (null: not made).
#[repr(C)]
pub(super) struct LaneTable {
    lanes: [*mut Lane; PER_TABLE],
}

/// A thread's lanes made on demand.
pub(super) struct DynamicLanes {
    /// Owner-only (and the registry, under its lock, when the thread retires).
    tables: [Cell<*mut LaneTable>; TABLES],
    /// The lanes, linked through [`Lane::next`]; changed under the registry lock, walked
    /// by readers holding it.
    head: AtomicPtr<Lane>,
}

impl DynamicLanes {
    pub(super) const fn new() -> Self {
        Self {
            tables: [const { Cell::new(null_mut()) }; TABLES],
            head: AtomicPtr::new(null_mut()),
        }
    }

    /// The lane of `tag` if this thread made it (owner only).
    #[inline]
    pub(super) fn get(&self, tag: Tag) -> Option<&Lane> {
        let tag = usize::from(tag);
        let table = self.tables.get(tag / PER_TABLE)?.get();
        if table.is_null() {
            return None;
        }
        // SAFETY: a non-null table pointer is a live table of this thread; its non-null
        // entries are lanes made for this thread, valid until it retires.
        unsafe { (*table).lanes[tag % PER_TABLE].as_ref() }
    }

    /// Makes this thread's lane of `tag` (owner, under the registry lock that gave `list`);
    /// `None` when the OS refuses memory. The lane is fresh: empty bins, zero counts, closed.
    pub(super) fn make(&self, tag: Tag, list: &mut ThreadList) -> Option<&Lane> {
        let index = usize::from(tag);
        let cell = self.tables.get(index / PER_TABLE)?;
        if cell.get().is_null() {
            cell.set(list.take_table()?);
        }
        let lane = list.take_lane()?;
        // SAFETY: the table is this thread's; the lane is fresh from the pool and ours.
        unsafe {
            (*cell.get()).lanes[index % PER_TABLE] = lane;
            Some(&*lane)
        }
    }

    /// Lists a lane made by [`make`](Self::make) and set up, so walks reach it.
    ///
    /// # Safety
    /// Under the registry lock; `lane` was made for this thread and is not listed yet.
    pub(super) unsafe fn link(&self, lane: &Lane) {
        lane.next.store(self.head.load(Relaxed), Relaxed);
        self.head.store(ptr::from_ref(lane).cast_mut(), Release);
    }

    /// The listed lanes (readers: the owner, or anyone holding the registry lock).
    pub(super) fn iter(&self) -> impl Iterator<Item = &Lane> {
        let mut lane = self.head.load(Acquire);
        core::iter::from_fn(move || {
            // SAFETY: listed lanes stay valid until the owner retires, under the lock the
            // reader holds (or the owner is the reader).
            let current = unsafe { lane.as_ref()? };
            lane = current.next.load(Relaxed);
            Some(current)
        })
    }

    /// Gives every lane and table back to the pool (the thread retires).
    ///
    /// # Safety
    /// Under the registry lock that gave `list`; the lanes are flushed, absorbed and shut,
    /// and nothing will use them through this thread again.
    pub(super) unsafe fn release_all(&self, list: &mut ThreadList) {
        let mut lane = self.head.swap(null_mut(), Relaxed);
        while !lane.is_null() {
            // SAFETY: listed lanes are valid; each goes back once.
            unsafe {
                let next = (*lane).next.load(Relaxed);
                list.give_lane(lane);
                lane = next;
            }
        }
        for cell in &self.tables {
            let table = cell.replace(null_mut());
            if !table.is_null() {
                // SAFETY: the thread's own table, no longer referenced.
                unsafe { list.give_table(table) };
            }
        }
    }
}

/// Free lanes and tables of every thread, kept in the registry's list.
pub(super) struct LanePool {
    /// Lanes given back by exited threads, linked through [`Lane::next`].
    lanes: *mut Lane,
    tables: *mut LaneTable,
    /// The part of the newest lane slab not handed out yet (`fresh_left` lanes from
    /// `fresh`): a lane is written only when it is taken, so the slab's untaken lanes stay
    /// untouched memory (a lane is about 5 KiB).
    fresh: *mut Lane,
    fresh_left: usize,
}

impl LanePool {
    pub(super) const fn new() -> Self {
        Self {
            lanes: null_mut(),
            tables: null_mut(),
            fresh: null_mut(),
            fresh_left: 0,
        }
    }
}

impl ThreadList {
    /// A fresh lane: one given back, else the next of the newest slab (a new slab mapped
    /// when that is used up).
    fn take_lane(&mut self) -> Option<*mut Lane> {
        let lane = if !self.pool.lanes.is_null() {
            let lane = self.pool.lanes;
            // SAFETY: pooled lanes are valid and owned by the pool; this one leaves it.
            self.pool.lanes = unsafe { (*lane).next.load(Relaxed) };
            lane
        } else {
            if self.pool.fresh_left == 0 {
                self.pool.fresh = map_slab()?.cast();
                self.pool.fresh_left = SLAB / size_of::<Lane>();
            }
            let lane = self.pool.fresh;
            // SAFETY: `fresh` has `fresh_left` (at least one) lanes' room left in a slab
            // mapped for lanes (`map_slab`); the next one follows it or the count ends.
            self.pool.fresh = unsafe { lane.add(1) };
            self.pool.fresh_left -= 1;
            lane
        };
        // SAFETY: the lane's memory is the pool's, aligned for a lane, and now this caller's;
        // it is reset whole.
        unsafe { lane.write(Lane::new(HOOKS_UNREGISTERED)) };
        Some(lane)
    }

    /// Takes back a lane.
    ///
    /// # Safety
    /// `lane` came from [`take_lane`](Self::take_lane) and nothing uses it any more.
    unsafe fn give_lane(&mut self, lane: *mut Lane) {
        // SAFETY: forwarded from the caller.
        unsafe { (*lane).next.store(self.pool.lanes, Relaxed) };
        self.pool.lanes = lane;
    }

    /// A zeroed table from the pool.
    fn take_table(&mut self) -> Option<*mut LaneTable> {
        if self.pool.tables.is_null() {
            let slab = map_slab()?;
            for i in 0..SLAB / size_of::<LaneTable>() {
                // SAFETY: as in `take_lane`; a pooled table's first entry links the next.
                unsafe {
                    let table = slab.cast::<LaneTable>().add(i);
                    (*table).lanes[0] = self.pool.tables.cast();
                    self.pool.tables = table;
                }
            }
        }
        let table = self.pool.tables;
        // SAFETY: pooled tables are valid and owned by the pool; this one leaves it, zeroed.
        unsafe {
            self.pool.tables = (*table).lanes[0].cast();
            (*table).lanes = [null_mut(); PER_TABLE];
        }
        Some(table)
    }

    /// Takes back a table.
    ///
    /// # Safety
    /// `table` came from [`take_table`](Self::take_table) and nothing uses it any more.
    unsafe fn give_table(&mut self, table: *mut LaneTable) {
        // SAFETY: forwarded from the caller.
        unsafe { (*table).lanes[0] = self.pool.tables.cast() };
        self.pool.tables = table;
    }
}

/// Maps a slab for the pool; `None` when the OS refuses. Slabs are never unmapped: lanes
/// of exited threads serve the next ones.
fn map_slab() -> Option<*mut u8> {
    const { assert!(align_of::<Lane>() <= 4096 && align_of::<LaneTable>() <= 4096) };
    let p = OsAllocator.map(SLAB, OsAllocator.granularity(), 0);
    (!p.is_null()).then_some(p)
}
