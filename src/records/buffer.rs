//! Per-thread record tables: each thread's basic records, written by that thread alone, so
//! that a block allocated and freed on the same thread never touches a lock, an atomic
//! read-modify-write or the shared [`table`](super::table), however many blocks are live.
//!
//! A thread's records live in an open-addressing table of its own (linear probing, keyed
//! by address and allocator, [`Slot`]s of plain atomics) with per-allocator totals. The
//! table grows (and sheds tombstones) by rehashing into a new array from the records' own
//! heap: when that heap is out of memory, the record goes to the shared table instead (and
//! is dropped and counted there if that fails too). Records reach the shared table only
//! when their thread exits and before a `fork()` child adopts the table of a thread that
//! did not survive the fork.
//!
//! Other threads read a table through a sequence lock on its departures: the owner makes
//! `seq` odd while it removes records and even after; a reader retries when `seq` moved
//! (after a few tries it asks the owner to pause at its next call, so a busy owner cannot
//! starve it). A new record only fills a free slot: its fields are written before its
//! address, which shows it (a release store), and a slot's fields change only after its
//! record left, which moves `seq`, so inserts leave `seq` alone. A removed record leaves a
//! tombstone, or an empty slot when the next slot is empty (so tombstones rarely pile up);
//! slots never move except in a rehash, which happens under the table's `array` lock that
//! every other thread holds while it looks at the slots (so no reader ever sees a freed
//! array). Every field is an atomic accessed with relaxed loads and stores (the address
//! with release and acquire), which are plain moves on x86-64.
//!
//! The owner's common cases (an insert with room, a free of a record of its own) call
//! nothing, so the allocator paths that inline them need no saved registers; anything else
//! (a request to serve, a rehash, a miss) returns to a slower path that does it.
//!
//! Exactness with cross-thread frees: a free whose record is not in its own thread's table
//! takes the record's shard lock and looks in the shared table, then in every other
//! thread's table (under its `array` lock). It cannot remove a record from another thread's
//! table, so it marks it dead in place (a bit of the slot's meta word, set with an atomic
//! OR: no owner write touches a live record's slot) and notes its key in the owner's inbox
//! (and sets a flag the owner tests on every call); the owner drops its dead records before
//! its next record operation (or all at once when the inbox overflowed, by a scan). A
//! record moves from a table to the shared table only under its shard lock, after its
//! owner checked the dead bit under that lock, so a free never misses a record in flight
//! and a dead record is never published. Readers (reports, [`live_totals`](super::live_totals))
//! hold every shard lock, then each table's `array` lock in turn, copy its records and skip
//! the dead ones.
//!
//! Lock order: buffer list → shard locks → a table's `array` lock → inboxes → the records'
//! heap. An owner never waits for anything while its `seq` is odd, so a reader holding
//! locks and waiting for an even `seq` always gets it; it takes its `array` lock only to
//! swap in a rehashed array, with `seq` even and nothing else held.
//!
//! (This replaced a 64-record buffer that moved its records to the shared table one by one
//! when full: over live sets larger than the buffer, nearly every record then took a shard
//! lock twice, which cost basic records about 5x the allocator's own work. mimalloc keeps
//! its per-thread heaps the same way, thread-owned with a remote-free list the owner
//! collects; heaptrack and Unreal's LLM keep one locked table, which is what this avoids.)

use super::heap::Internal;
use super::table::{self, Key, Rec};
use crate::sync::SpinLock;
use allocator_api2::alloc::Allocator;
use core::alloc::Layout;
use core::ptr::{self, NonNull};
use core::sync::atomic::{
    AtomicBool, AtomicPtr, AtomicU32, AtomicU64, AtomicUsize, Ordering::*, compiler_fence, fence,
};

/// Slots of a fresh table (a power of two).
const INITIAL: usize = 256;
/// A slot's address when it is empty (no block lives at address 0).
const EMPTY: usize = 0;
/// A slot's address when its record left and a probe must go on past it.
const TOMB: usize = usize::MAX;
/// The meta word's bit for a record another thread freed (see the [module docs](self)).
const DEAD: u64 = 1 << 63;
/// The meta word's allocator bits.
const ALLOC_BITS: u64 = 0xFFFF_FFFF;
/// Where a record's site slot sits in its meta word.
const SITE_SHIFT: u32 = 40;
/// Keys an inbox holds before it overflows (the owner then scans for dead records).
const INBOX_KEYS: usize = 64;

/// Allocators with per-thread totals per table (records of a fifth go to the shared table).
const SITES: usize = 4;
const _: () = assert!(SITES.is_power_of_two() && INITIAL.is_power_of_two());
/// A record's time is the clock read at the last rehash or claim, or at a departure (a
/// record freed or moved out of the table) about this many departures earlier on the same
/// thread: a clock read costs as much as the rest of the record.
const TICK_EVERY: u64 = 32;

/// `requests`: dead records wait in the inbox.
const INBOX: u32 = 1;
/// `requests`: one reader asks the owner to pause (a count, in these units).
const PAUSE: u32 = 2;

/// The multiplier of the slot hash (Fibonacci hashing: the product's top bits).
const HASH: u64 = 0x9E37_79B9_7F4A_7C15;

/// One record's slot. `addr` is [`EMPTY`], [`TOMB`] or the block's address; the other
/// fields are meaningful only under a block's address.
#[repr(C)]
struct Slot {
    addr: AtomicUsize,
    /// Allocator index, the alignment's log2 in bits 32..40, the site slot in bits
    /// [`SITE_SHIFT`].., and [`DEAD`].
    meta: AtomicU64,
    /// Granted bytes.
    size: AtomicUsize,
    requested: AtomicUsize,
    time: AtomicU64,
}

impl Slot {
    const fn empty() -> Slot {
        Slot {
            addr: AtomicUsize::new(EMPTY),
            meta: AtomicU64::new(0),
            size: AtomicUsize::new(0),
            requested: AtomicUsize::new(0),
            time: AtomicU64::new(0),
        }
    }

    /// Whether a record (live or dead) is here.
    #[inline(always)]
    fn occupied(addr: usize) -> bool {
        addr != EMPTY && addr != TOMB
    }

    fn entry(&self) -> Entry {
        let meta = self.meta.load(Relaxed);
        Entry {
            addr: self.addr.load(Relaxed),
            alloc: meta as u32,
            size: self.size.load(Relaxed),
            requested: self.requested.load(Relaxed),
            time: self.time.load(Relaxed),
            align_log2: (meta >> 32) as u8,
        }
    }
}

/// A table's array as one thread sees it (loaded once per operation).
#[derive(Clone, Copy)]
struct View {
    slots: *const Slot,
    mask: usize,
    shift: u32,
}

impl View {
    /// The slot of `addr`'s first probe.
    #[inline(always)]
    fn home(self, addr: usize) -> usize {
        ((addr as u64).wrapping_mul(HASH) >> self.shift) as usize & self.mask
    }

    /// Slot `i` (masked).
    #[inline(always)]
    fn slot<'a>(self, i: usize) -> &'a Slot {
        // SAFETY: the index is masked into the array, which stays allocated while its
        // owner or a holder of its table's `array` lock looks at it (see `Buf::view`).
        unsafe { &*self.slots.add(i & self.mask) }
    }
}

/// A table's totals for one allocator. The most live at once is checked as records leave
/// (a peak is always followed by a departure, or still there when read).
#[repr(align(64))]
struct Site {
    /// Registry index, or `u32::MAX` while unused.
    alloc: AtomicU32,
    total_bytes: AtomicU64,
    total_blocks: AtomicU64,
    live_bytes: AtomicU64,
    live_blocks: AtomicU64,
    max_bytes: AtomicU64,
    max_blocks: AtomicU64,
}

impl Site {
    /// A record of `size` bytes comes in.
    #[inline(always)]
    fn added(&self, size: usize) {
        add(&self.total_bytes, size as u64);
        add(&self.total_blocks, 1);
        add(&self.live_bytes, size as u64);
        add(&self.live_blocks, 1);
    }

    /// A record of `size` bytes leaves: the live bytes before it left may be the most so
    /// far.
    #[inline(always)]
    fn left(&self, size: usize) {
        let live = self.live_bytes.load(Relaxed);
        let blocks = self.live_blocks.load(Relaxed);
        if live > self.max_bytes.load(Relaxed) {
            self.max_bytes.store(live, Relaxed);
            self.max_blocks.store(blocks, Relaxed);
        }
        self.live_bytes
            .store(live.wrapping_sub(size as u64), Relaxed);
        self.live_blocks.store(blocks.wrapping_sub(1), Relaxed);
    }

    /// The totals, with the live bytes now counted towards the most at once.
    fn totals(&self) -> SiteTotals {
        let (live, blocks) = (
            self.live_bytes.load(Relaxed),
            self.live_blocks.load(Relaxed),
        );
        let (mut max_bytes, mut max_blocks) =
            (self.max_bytes.load(Relaxed), self.max_blocks.load(Relaxed));
        if live > max_bytes {
            (max_bytes, max_blocks) = (live, blocks);
        }
        SiteTotals {
            alloc: self.alloc.load(Relaxed),
            total_bytes: self.total_bytes.load(Relaxed),
            total_blocks: self.total_blocks.load(Relaxed),
            max_bytes,
            max_blocks,
        }
    }

    /// Back to unused (its table retires).
    fn clear(&self) {
        for a in [
            &self.total_bytes,
            &self.total_blocks,
            &self.live_bytes,
            &self.live_blocks,
            &self.max_bytes,
            &self.max_blocks,
        ] {
            a.store(0, Relaxed);
        }
        self.alloc.store(u32::MAX, Relaxed);
    }

    const fn new() -> Self {
        Self {
            alloc: AtomicU32::new(u32::MAX),
            total_bytes: AtomicU64::new(0),
            total_blocks: AtomicU64::new(0),
            live_bytes: AtomicU64::new(0),
            live_blocks: AtomicU64::new(0),
            max_bytes: AtomicU64::new(0),
            max_blocks: AtomicU64::new(0),
        }
    }
}

/// What a reader copies of one site.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct SiteTotals {
    pub(crate) alloc: u32,
    pub(crate) total_bytes: u64,
    pub(crate) total_blocks: u64,
    pub(crate) max_bytes: u64,
    pub(crate) max_blocks: u64,
}

/// Keys of records another thread marked dead, for the owner to drop.
struct Inbox {
    len: usize,
    /// More were marked than `keys` holds: the owner scans its whole table.
    overflow: bool,
    keys: [(usize, u32); INBOX_KEYS],
}

/// One record as a reader or the owner copies it out.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Entry {
    pub(crate) addr: usize,
    pub(crate) alloc: u32,
    pub(crate) size: usize,
    pub(crate) requested: usize,
    pub(crate) time: u64,
    pub(crate) align_log2: u8,
}

impl Entry {
    /// The record as the shared table keeps it.
    pub(crate) fn rec(&self, thread: u32) -> Rec {
        Rec {
            size: self.size,
            requested: self.requested,
            time: self.time,
            weight: 1.0,
            thread,
            stack: 0,
            align_log2: self.align_log2,
            sampled: false,
            timed: false,
            site: 0,
        }
    }

    pub(crate) fn key(&self) -> Key {
        Key {
            addr: self.addr,
            alloc: self.alloc,
        }
    }
}

/// One thread's record table (see the [module docs](self)). Allocated from the records'
/// heap, never freed: a retired one is reused by the next new thread.
#[repr(C, align(128))]
pub(crate) struct Buf {
    seq: AtomicU64,
    requests: AtomicU32,
    /// 64 − log2 of the capacity: a slot's home is the hash's top bits.
    shift: AtomicU32,
    /// The slot array (null before the first claim).
    slots: AtomicPtr<Slot>,
    /// Capacity − 1.
    mask: AtomicUsize,
    /// Slots that are not [`EMPTY`] (owner only).
    used: AtomicUsize,
    /// How far `used` may go before a rehash (owner only).
    limit: AtomicUsize,
    /// The last clock read (owner only).
    tick: AtomicU64,
    tid: AtomicU32,
    /// Whether a live thread owns it.
    owned: AtomicBool,
    sites: [Site; SITES],
    /// Held by other threads while they look at the slots, and by the owner while it
    /// swaps in another array.
    array: SpinLock<()>,
    inbox: SpinLock<Inbox>,
    next: AtomicPtr<Buf>,
}

/// Every table ever made (a list that only grows; readers walk it without a lock).
static HEAD: AtomicPtr<Buf> = AtomicPtr::new(ptr::null_mut());
/// Serialises claims (and is held across `fork()`).
static LIST: SpinLock<()> = SpinLock::new(());

/// A fresh array of `cap` empty slots from the records' heap.
fn new_slots(cap: usize) -> Option<NonNull<Slot>> {
    let layout = Layout::array::<Slot>(cap).ok()?;
    let block: NonNull<Slot> = Internal.allocate(layout).ok()?.cast();
    for i in 0..cap {
        // SAFETY: the block holds `cap` slots; each is written once before it is shared.
        unsafe { block.as_ptr().add(i).write(Slot::empty()) };
    }
    Some(block)
}

/// Gives an array from [`new_slots`] back.
///
/// # Safety
/// `slots` came from `new_slots(cap)` and nothing refers to it any more.
unsafe fn free_slots(slots: NonNull<Slot>, cap: usize) {
    // SAFETY: the layout it was allocated with (it was valid then); per the caller.
    unsafe {
        let layout = Layout::array::<Slot>(cap).unwrap_unchecked();
        Internal.deallocate(slots.cast(), layout);
    }
}

impl Buf {
    const fn new() -> Self {
        Self {
            seq: AtomicU64::new(0),
            requests: AtomicU32::new(0),
            shift: AtomicU32::new(0),
            slots: AtomicPtr::new(ptr::null_mut()),
            mask: AtomicUsize::new(0),
            used: AtomicUsize::new(0),
            limit: AtomicUsize::new(0),
            tick: AtomicU64::new(0),
            tid: AtomicU32::new(0),
            owned: AtomicBool::new(false),
            sites: [const { Site::new() }; SITES],
            array: SpinLock::new(()),
            inbox: SpinLock::new(Inbox {
                len: 0,
                overflow: false,
                keys: [(0, 0); INBOX_KEYS],
            }),
            next: AtomicPtr::new(ptr::null_mut()),
        }
    }

    /// Installs `slots` of capacity `cap` holding `used` occupied slots (owner, with
    /// `array` held or no other thread able to see the table).
    fn install(&self, slots: NonNull<Slot>, cap: usize, used: usize) {
        self.slots.store(slots.as_ptr(), Relaxed);
        self.mask.store(cap - 1, Relaxed);
        self.shift.store(64 - cap.trailing_zeros(), Relaxed);
        self.used.store(used, Relaxed);
        self.limit.store(cap / 8 * 5, Relaxed);
    }

    /// The capacity (0 before the first array).
    fn capacity(&self) -> usize {
        if self.slots.load(Relaxed).is_null() {
            0
        } else {
            self.mask.load(Relaxed) + 1
        }
    }

    /// Records in the table, dead ones not dropped yet included (the sites' live blocks).
    fn records(&self) -> usize {
        self.sites
            .iter()
            .map(|s| s.live_blocks.load(Relaxed) as usize)
            .sum()
    }

    /// The current array, for the owner or a holder of `array` (only the owner swaps it,
    /// under `array`, and frees the old one after). Not for a table without an array.
    #[inline(always)]
    fn view(&self) -> View {
        View {
            slots: self.slots.load(Relaxed),
            mask: self.mask.load(Relaxed),
            shift: self.shift.load(Relaxed),
        }
    }

    /// The slot of a live (not dead) record, probing from its home. The owner's view, or
    /// a reader's inside [`read_with`](Self::read_with) under `array`: a probe meets an
    /// empty slot within the capacity (a table is at most 5/8 occupied), and is cut there
    /// anyway.
    #[inline(always)]
    fn probe_bounded(&self, addr: usize, alloc: u32) -> Option<(View, usize)> {
        let v = self.view();
        let mut i = v.home(addr);
        for _ in 0..=v.mask {
            let slot = v.slot(i);
            let a = slot.addr.load(Acquire);
            if a == addr && slot.meta.load(Relaxed) & (DEAD | ALLOC_BITS) == u64::from(alloc) {
                return Some((v, i));
            }
            if a == EMPTY {
                return None;
            }
            i = (i + 1) & v.mask;
        }
        None
    }

    // ---- The owner's side. ----

    /// [`probe_bounded`](Self::probe_bounded) for the owner, whose table always has an
    /// empty slot (at most 5/8 are used), so the probe needs no count.
    #[inline(always)]
    fn probe(&self, addr: usize, alloc: u32) -> Option<(View, usize)> {
        let v = self.view();
        let mut i = v.home(addr);
        loop {
            let slot = v.slot(i);
            let a = slot.addr.load(Relaxed);
            if a == addr && slot.meta.load(Relaxed) & (DEAD | ALLOC_BITS) == u64::from(alloc) {
                return Some((v, i));
            }
            if a == EMPTY {
                return None;
            }
            i = (i + 1) & v.mask;
        }
    }

    /// Reads the clock for the records made from now on.
    #[cold]
    #[inline(never)]
    fn read_clock(&self) {
        self.tick.store(super::clock::ticks(), Relaxed);
    }

    /// Starts a write that removes records: `seq` odd. `None` (and `seq` even again,
    /// nothing written) when a request is pending: serve it and retry.
    #[inline(always)]
    fn begin(&self) -> Option<u64> {
        let s = self.seq.load(Relaxed);
        self.seq.store(s + 1, Relaxed);
        // The odd `seq` is ordered before the writes that follow (a sequence lock's writer).
        fence(Release);
        // The request is read after the odd store as far as the compiler goes; `fork()`
        // makes the CPU agree with a process-wide barrier (see `before_fork`).
        compiler_fence(SeqCst);
        if self.requests.load(Relaxed) != 0 {
            self.seq.store(s, Release);
            return None;
        }
        Some(s)
    }

    /// Starts a write without looking at requests (short windows inside slow paths).
    #[inline(always)]
    fn begin_anyway(&self) -> u64 {
        let s = self.seq.load(Relaxed);
        self.seq.store(s + 1, Relaxed);
        fence(Release);
        s
    }

    #[inline(always)]
    fn end(&self, s: u64) {
        self.seq.store(s + 2, Release);
    }

    /// Abandons a write that wrote nothing.
    #[inline(always)]
    fn abandon(&self, s: u64) {
        self.seq.store(s, Release);
    }

    /// Serves what other threads asked for: drops dead records, waits out a pause.
    #[cold]
    fn serve(&self) {
        if self.requests.load(Acquire) & INBOX != 0 {
            self.drain();
        }
        let mut spins = 0u32;
        while self.requests.load(Acquire) >= PAUSE {
            spins += 1;
            if spins < 64 {
                core::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
    }

    /// Drops the records other threads marked dead.
    #[cold]
    fn drain(&self) {
        let mut keys = [(0usize, 0u32); INBOX_KEYS];
        let (n, overflow) = {
            let mut inbox = self.inbox.lock();
            let n = inbox.len;
            let overflow = inbox.overflow;
            keys[..n].copy_from_slice(&inbox.keys[..n]);
            inbox.len = 0;
            inbox.overflow = false;
            self.requests.fetch_and(!INBOX, AcqRel);
            (n, overflow)
        };
        if self.capacity() == 0 {
            return;
        }
        let s = self.begin_anyway();
        if overflow {
            let v = self.view();
            for i in 0..=v.mask {
                let slot = v.slot(i);
                if Slot::occupied(slot.addr.load(Relaxed)) && slot.meta.load(Acquire) & DEAD != 0 {
                    self.remove_at(v, i);
                }
            }
        } else {
            for &(addr, alloc) in &keys[..n] {
                self.drop_dead(addr, alloc);
            }
        }
        self.end(s);
    }

    /// Removes the dead records of one key (inside a write).
    fn drop_dead(&self, addr: usize, alloc: u32) {
        let v = self.view();
        let mut i = v.home(addr);
        for _ in 0..=v.mask {
            let slot = v.slot(i);
            let a = slot.addr.load(Relaxed);
            if a == EMPTY {
                return;
            }
            let meta = slot.meta.load(Acquire);
            if a == addr && meta & (DEAD | ALLOC_BITS) == DEAD | u64::from(alloc) {
                self.remove_at(v, i);
                if slot.addr.load(Relaxed) == EMPTY {
                    return;
                }
            }
            i = (i + 1) & v.mask;
        }
    }

    /// Removes the record in slot `i` of the current array `v` and takes it off its
    /// site's live totals. Inside a write.
    ///
    /// The slot becomes empty if the next one is (no probe went on past it to a record),
    /// else a tombstone (an insert whose probe meets it reuses it; a rehash drops the
    /// rest).
    #[inline(always)]
    fn remove_at(&self, v: View, i: usize) {
        let slot = v.slot(i);
        let meta = slot.meta.load(Relaxed);
        self.sites[(meta >> SITE_SHIFT) as usize % SITES].left(slot.size.load(Relaxed));
        if v.slot(i + 1).addr.load(Relaxed) != EMPTY {
            slot.addr.store(TOMB, Relaxed);
            return;
        }
        slot.addr.store(EMPTY, Relaxed);
        self.used
            .store(self.used.load(Relaxed).wrapping_sub(1), Relaxed);
    }

    /// The site slot for `alloc`, claiming a free one.
    #[inline(always)]
    fn site_for(&self, alloc: u32) -> Option<usize> {
        if let Some(j) = self
            .sites
            .iter()
            .position(|s| s.alloc.load(Relaxed) == alloc)
        {
            return Some(j);
        }
        self.claim_site(alloc)
    }

    #[cold]
    fn claim_site(&self, alloc: u32) -> Option<usize> {
        let j = self
            .sites
            .iter()
            .position(|s| s.alloc.load(Relaxed) == u32::MAX)?;
        self.sites[j].alloc.store(alloc, Relaxed);
        Some(j)
    }

    /// Records a new block if that takes no more than filling a slot (calls nothing);
    /// `false`: the table must rehash, a request waits, or the allocator is not the first
    /// site's (see [`push_slow`](Self::push_slow)).
    ///
    /// An insert writes the record's fields and then its address (a release store), so
    /// readers never see it half written and `seq` stays as it is. Its time is the clock
    /// read at the last departure that read it (see [`TICK_EVERY`]).
    #[inline(always)]
    pub(crate) fn push(
        &self,
        addr: usize,
        alloc: u32,
        size: usize,
        requested: usize,
        align_log2: u8,
    ) -> bool {
        // One test for all three ways off the fast path: a full table, a request (dead
        // records are dropped and readers served first), an allocator other than the first
        // site's.
        if self.used.load(Relaxed) < self.limit.load(Relaxed)
            && self.requests.load(Relaxed) == 0
            && self.sites[0].alloc.load(Relaxed) == alloc
        {
            self.insert(0, addr, alloc, size, requested, align_log2);
            return true;
        }
        false
    }

    /// Records a new block, serving requests and rehashing first; `false` when it cannot
    /// (no site left for its allocator, or no memory to grow): record it in the shared
    /// table instead.
    #[cold]
    #[inline(never)]
    pub(crate) fn push_slow(
        &self,
        addr: usize,
        alloc: u32,
        size: usize,
        requested: usize,
        align_log2: u8,
    ) -> bool {
        loop {
            if self.requests.load(Acquire) != 0 {
                self.serve();
                continue;
            }
            if self.used.load(Relaxed) >= self.limit.load(Relaxed) {
                if !self.rehash() {
                    return false;
                }
                continue;
            }
            let Some(site) = self.site_for(alloc) else {
                return false;
            };
            self.insert(site, addr, alloc, size, requested, align_log2);
            return true;
        }
    }

    /// Fills the first free slot of `addr`'s probe (there is one: `used` is below the
    /// limit), then counts the record in its site.
    #[inline(always)]
    fn insert(
        &self,
        site: usize,
        addr: usize,
        alloc: u32,
        size: usize,
        requested: usize,
        align_log2: u8,
    ) {
        let v = self.view();
        let mut i = v.home(addr);
        let slot = loop {
            let slot = v.slot(i);
            let a = slot.addr.load(Relaxed);
            if a == EMPTY {
                self.used.store(self.used.load(Relaxed) + 1, Relaxed);
                break slot;
            }
            if a == TOMB {
                break slot;
            }
            i = (i + 1) & v.mask;
        };
        let meta = u64::from(alloc) | u64::from(align_log2) << 32 | (site as u64) << SITE_SHIFT;
        slot.meta.store(meta, Relaxed);
        slot.size.store(size, Relaxed);
        slot.requested.store(requested, Relaxed);
        slot.time.store(self.tick.load(Relaxed), Relaxed);
        slot.addr.store(addr, Release);
        self.sites[site % SITES].added(size);
    }

    /// Moves the live records into a new array sized for them (3/8 full at most, 5/8
    /// before the next rehash), dropping dead ones and tombstones. `false` when the
    /// records' heap has no memory for it (the table is unchanged).
    #[cold]
    #[inline(never)]
    fn rehash(&self) -> bool {
        if self.requests.load(Acquire) & INBOX != 0 {
            self.drain();
        }
        let live = self.records();
        let cap = ((live + 1) * 8 / 3 + 1).next_power_of_two().max(INITIAL);
        let Some(new) = new_slots(cap) else {
            return false;
        };
        let old = self.slots.load(Relaxed);
        let old_cap = self.capacity();
        let guard = self.array.lock();
        let s = self.begin_anyway();
        let mut kept = 0;
        for i in 0..old_cap {
            // SAFETY: `i` below the old capacity; only this thread frees it (below).
            let from = unsafe { &*old.add(i) };
            let addr = from.addr.load(Relaxed);
            if !Slot::occupied(addr) {
                continue;
            }
            // Dead bits are set under `array`, which this thread holds.
            let meta = from.meta.load(Relaxed);
            if meta & DEAD != 0 {
                self.sites[(meta >> SITE_SHIFT) as usize % SITES].left(from.size.load(Relaxed));
                continue;
            }
            let mut j = ((addr as u64).wrapping_mul(HASH) >> (64 - cap.trailing_zeros())) as usize;
            let to = loop {
                // SAFETY: `j` masked below `cap`, inside the new array (not shared yet).
                let to = unsafe { &*new.as_ptr().add(j) };
                if to.addr.load(Relaxed) == EMPTY {
                    break to;
                }
                j = (j + 1) & (cap - 1);
            };
            to.meta.store(meta, Relaxed);
            to.size.store(from.size.load(Relaxed), Relaxed);
            to.requested.store(from.requested.load(Relaxed), Relaxed);
            to.time.store(from.time.load(Relaxed), Relaxed);
            to.addr.store(addr, Relaxed);
            kept += 1;
        }
        self.install(new, cap, kept);
        self.end(s);
        drop(guard);
        if let Some(old) = NonNull::new(old) {
            // SAFETY: from `new_slots(old_cap)`; swapped out under `array`, so no other
            // thread looks at it any more.
            unsafe { free_slots(old, old_cap) };
        }
        self.read_clock();
        true
    }

    /// Takes this thread's own record of a block out of the table (its realloc, or a free
    /// the fast path did not finish), if it is here.
    pub(crate) fn take_own(&self, addr: usize, alloc: u32) -> Option<Entry> {
        if self.used.load(Relaxed) == 0 {
            // Nothing here, dead or alive (a thread whose records all go to the shared
            // table, e.g. with stacks): no request needs serving first either.
            return None;
        }
        let s = loop {
            if let Some(s) = self.begin() {
                break s;
            }
            self.serve();
        };
        let Some((v, i)) = self.probe(addr, alloc) else {
            self.abandon(s);
            return None;
        };
        self.tick_at(s);
        let e = v.slot(i).entry();
        self.remove_at(v, i);
        self.end(s);
        Some(e)
    }

    /// Drops this thread's own record of a freed block if it is here and no request waits
    /// (calls nothing); `false` otherwise (then [`take_own`](Self::take_own) serves the
    /// request and looks again).
    #[inline(always)]
    pub(crate) fn forget_own(&self, addr: usize, alloc: u32) -> bool {
        if self.used.load(Relaxed) == 0 {
            return false;
        }
        let Some(s) = self.begin() else {
            return false;
        };
        let Some((v, i)) = self.probe(addr, alloc) else {
            self.abandon(s);
            return false;
        };
        self.tick_at(s);
        self.remove_at(v, i);
        self.end(s);
        true
    }

    /// Reads the clock at every [`TICK_EVERY`]th write (`seq` goes up by 2 per write, so it
    /// passes every multiple).
    #[inline(always)]
    fn tick_at(&self, s: u64) {
        if s % (2 * TICK_EVERY) == 0 {
            // Inline (`rdtsc`): a call would make the allocator paths that inline this
            // save registers on every free.
            self.tick.store(super::clock::ticks(), Relaxed);
        }
    }

    /// Moves every record to the shared table (its thread exits, or is gone after a
    /// `fork()`), and empties the table.
    #[cold]
    #[inline(never)]
    pub(crate) fn flush(&self) {
        let thread = self.tid.load(Relaxed);
        if self.requests.load(Acquire) & INBOX != 0 {
            self.drain();
        }
        if self.capacity() == 0 {
            return;
        }
        let v = self.view();
        for i in 0..=v.mask {
            let slot = v.slot(i);
            if !Slot::occupied(slot.addr.load(Relaxed)) {
                continue;
            }
            let e = slot.entry();
            let published = table::publish_with(e.key(), e.rec(thread), || {
                // Under the record's shard lock: a free that marked the record dead did so
                // under the same lock, so its bit shows here; without it, the record is
                // alive and leaves for the shared table.
                if slot.meta.load(Acquire) & DEAD != 0 {
                    return false;
                }
                let s = self.begin_anyway();
                self.remove_at(v, i);
                self.end(s);
                true
            });
            if !published {
                // Dead: dropped here (its key in the inbox then finds nothing).
                let s = self.begin_anyway();
                self.remove_at(v, i);
                self.end(s);
            }
        }
        // Every slot is empty or a tombstone now, and no other thread can find a record
        // here: start again from an empty array.
        let _array = self.array.lock();
        let s = self.begin_anyway();
        for i in 0..=v.mask {
            v.slot(i).addr.store(EMPTY, Relaxed);
        }
        self.used.store(0, Relaxed);
        self.end(s);
        let mut inbox = self.inbox.lock();
        inbox.len = 0;
        inbox.overflow = false;
        self.requests.fetch_and(!INBOX, AcqRel);
    }

    /// Moves the records to the shared table and the totals into the table's sites, and
    /// gives the table up for another thread (a large array goes back to the heap).
    fn retire(&self) {
        self.flush();
        for site in &self.sites {
            let alloc = site.alloc.load(Relaxed);
            if alloc == u32::MAX {
                continue;
            }
            let totals = SiteTotals {
                alloc,
                ..site.totals()
            };
            table::merge_retired(totals);
            let s = self.begin_anyway();
            site.clear();
            self.end(s);
        }
        let cap = self.capacity();
        if cap > INITIAL {
            if let Some(small) = new_slots(INITIAL) {
                let old = self.slots.load(Relaxed);
                {
                    let _array = self.array.lock();
                    self.install(small, INITIAL, 0);
                }
                if let Some(old) = NonNull::new(old) {
                    // SAFETY: from `new_slots(cap)`; swapped out under `array`.
                    unsafe { free_slots(old, cap) };
                }
            }
        }
        self.owned.store(false, Release);
    }

    // ---- Other threads' side. ----

    /// Runs `f` until it ran while the owner wrote nothing (a sequence-lock read).
    fn read_with<R>(&self, mut f: impl FnMut(&Self) -> R) -> R {
        let mut tries = 0u32;
        let mut paused = false;
        let result = loop {
            let s1 = self.seq.load(Acquire);
            if s1 & 1 == 0 {
                let r = f(self);
                fence(Acquire);
                if self.seq.load(Relaxed) == s1 {
                    break r;
                }
            }
            tries += 1;
            if tries == 8 && !paused {
                self.requests.fetch_add(PAUSE, AcqRel);
                paused = true;
            }
            core::hint::spin_loop();
        };
        if paused {
            self.requests.fetch_sub(PAUSE, AcqRel);
        }
        result
    }

    /// Finds a live record of another thread's block; marks it dead and returns it. Called
    /// under the record's shard lock and this table's `array` lock.
    fn take_remote(&self, addr: usize, alloc: u32) -> Option<Entry> {
        if self.capacity() == 0 {
            return None;
        }
        let (v, i, e) = self.read_with(|buf| {
            buf.probe_bounded(addr, alloc)
                .map(|(v, i)| (v, i, v.slot(i).entry()))
        })?;
        // The slot still holds the record: only its owner's free (this is it, on another
        // thread), a move to the shared table (under the shard lock held here) or a
        // rehash (under `array`, held here) could take it out.
        v.slot(i).meta.fetch_or(DEAD, AcqRel);
        let mut inbox = self.inbox.lock();
        let n = inbox.len;
        if n < INBOX_KEYS {
            inbox.keys[n] = (addr, alloc);
            inbox.len = n + 1;
        } else {
            inbox.overflow = true;
        }
        self.requests.fetch_or(INBOX, AcqRel);
        Some(e)
    }
}

#[inline(always)]
fn add(a: &AtomicU64, n: u64) {
    a.store(a.load(Relaxed).wrapping_add(n), Relaxed);
}

/// Every table, in list order.
fn all() -> impl Iterator<Item = &'static Buf> {
    let mut p = HEAD.load(Acquire);
    core::iter::from_fn(move || {
        // SAFETY: tables are never freed; list nodes are published with release stores.
        let buf = unsafe { p.as_ref()? };
        p = buf.next.load(Acquire);
        Some(buf)
    })
}

/// Whether any thread ever kept records (before that, a shared-table miss is final).
#[inline]
fn any() -> bool {
    !HEAD.load(Relaxed).is_null()
}

/// Finds `key`'s record in another thread's table, marks it dead there and returns it.
/// Called under the key's shard lock, after the shared table missed. `me` is the caller's
/// table (already searched).
pub(crate) fn take_from_others(key: Key, me: *const Buf) -> Option<Rec> {
    if !any() {
        return None;
    }
    for buf in all() {
        if ptr::eq(buf, me) || buf.used.load(Acquire) == 0 {
            continue;
        }
        let _array = buf.array.lock();
        if let Some(e) = buf.take_remote(key.addr, key.alloc) {
            return Some(e.rec(buf.tid.load(Relaxed)));
        }
    }
    None
}

/// Claims a table for the calling thread (a retired one, or a new one on the records'
/// heap) and registers it for the thread-exit flush. `None` if the heap is out of memory
/// or the exit hook cannot be set.
#[cold]
pub(crate) fn claim(tid: u32) -> Option<&'static Buf> {
    let key = exit_key()?;
    let buf = {
        let _list = LIST.lock();
        match all().find(|b| {
            b.owned
                .compare_exchange(false, true, Acquire, Relaxed)
                .is_ok()
        }) {
            Some(b) => b,
            None => {
                let slots = new_slots(INITIAL)?;
                let Some(block) = super::heap::RECORDS_HEAP.allocate(Layout::new::<Buf>()) else {
                    // SAFETY: just allocated, never shared.
                    unsafe { free_slots(slots, INITIAL) };
                    return None;
                };
                let p: *mut Buf = block.ptr.as_ptr().cast();
                // SAFETY: the block is fresh, sized and aligned for a `Buf` (the heap honours
                // the layout's alignment), and written before it is shared.
                unsafe {
                    p.write(Buf::new());
                    (*p).install(slots, INITIAL, 0);
                    (*p).owned.store(true, Relaxed);
                    (*p).next.store(HEAD.load(Relaxed), Relaxed);
                }
                HEAD.store(p, Release);
                // SAFETY: initialised above; never freed.
                unsafe { &*p }
            }
        }
    };
    buf.tid.store(tid, Relaxed);
    buf.read_clock();
    // SAFETY: the key exists; the value is the thread's table, handed to `on_thread_exit`.
    unsafe { libc::pthread_setspecific(key, ptr::from_ref(buf).cast()) };
    Some(buf)
}

static EXIT_KEY: AtomicU64 = AtomicU64::new(u64::MAX);
static EXIT_KEY_LOCK: SpinLock<()> = SpinLock::new(());

/// The pthread key whose destructor retires a thread's table (created once).
fn exit_key() -> Option<libc::pthread_key_t> {
    let k = EXIT_KEY.load(Acquire);
    if k != u64::MAX {
        return Some(k as libc::pthread_key_t);
    }
    let _g = EXIT_KEY_LOCK.lock();
    let k = EXIT_KEY.load(Acquire);
    if k != u64::MAX {
        return Some(k as libc::pthread_key_t);
    }
    let mut key: libc::pthread_key_t = 0;
    // SAFETY: `key` is writable; the destructor has the signature pthread wants.
    if unsafe { libc::pthread_key_create(&mut key, Some(on_thread_exit)) } != 0 {
        return None;
    }
    EXIT_KEY.store(u64::from(key), Release);
    Some(key)
}

/// Runs on an exiting thread (after its Rust TLS destructors): later records of this
/// thread go straight to the shared table.
unsafe extern "C" fn on_thread_exit(buf: *mut libc::c_void) {
    super::guard::buffer_gone();
    // SAFETY: the value set by `claim`: this thread's table, never freed.
    let buf = unsafe { &*buf.cast::<Buf>() };
    buf.retire();
}

/// What a reader does with the records of each thread's table.
pub(crate) trait Visit {
    /// A table's copy starts: what [`rewind`](Self::rewind) goes back to.
    fn mark(&mut self) {}
    /// The copy of the current table starts again (its owner wrote meanwhile): forget
    /// what was visited since [`mark`](Self::mark).
    fn rewind(&mut self) {}
    /// One live record.
    fn record(&mut self, key: Key, rec: Rec);
    /// One allocator's totals in a table, with its live records' bytes and blocks.
    fn site(&mut self, _totals: SiteTotals, _live_bytes: u64, _live_blocks: u64) {}
}

/// Visits every thread's live records and totals (dead ones left out). The caller holds
/// every shard lock, so no record enters or leaves a table through the shared table and no
/// record is marked dead meanwhile.
pub(crate) fn copy_all(v: &mut impl Visit) {
    if !any() {
        return;
    }
    for buf in all() {
        if !buf.owned.load(Acquire) {
            continue;
        }
        let _array = buf.array.lock();
        if buf.capacity() == 0 {
            continue;
        }
        let thread = buf.tid.load(Relaxed);
        v.mark();
        let (sites, live) = buf.read_with(|buf| {
            v.rewind();
            let mut sites = [SiteTotals::default(); SITES];
            let mut live = [(0u64, 0u64); SITES];
            let view = buf.view();
            for i in 0..=view.mask {
                let slot = view.slot(i);
                if !Slot::occupied(slot.addr.load(Acquire)) {
                    continue;
                }
                let meta = slot.meta.load(Relaxed);
                if meta & DEAD != 0 {
                    continue;
                }
                let e = slot.entry();
                v.record(e.key(), e.rec(thread));
                let j = (meta >> SITE_SHIFT) as usize % SITES;
                live[j].0 += e.size as u64;
                live[j].1 += 1;
            }
            for (site, t) in buf.sites.iter().zip(sites.iter_mut()) {
                *t = site.totals();
            }
            (sites, live)
        });
        for (s, (bytes, blocks)) in sites.into_iter().zip(live) {
            if s.alloc != u32::MAX {
                v.site(s, bytes, blocks);
            }
        }
    }
}

// ---- fork() ----

/// Before `fork()` (after the shared table's locks): holds every owner at the start of its
/// next departure, so no table is copied into the child half written (an insert in flight
/// is invisible there until its address store, and its site totals may count it: the block
/// is allocated all the same), then takes every table's `array` lock (no rehash half done).
///
/// # Safety
/// Must be followed by [`after_fork`] on the same thread.
pub(crate) unsafe fn before_fork() {
    // SAFETY: released by `after_fork`.
    unsafe { LIST.lock_raw() };
    for buf in all() {
        buf.requests.fetch_add(PAUSE, AcqRel);
    }
    // Owners test `requests` after making `seq` odd with only a compiler barrier; this
    // barrier makes every running thread's odd store visible before `seq` is read below.
    process_barrier();
    let me = super::guard::current_buffer();
    for buf in all() {
        if ptr::eq(buf, me) {
            continue;
        }
        while buf.seq.load(Acquire) & 1 != 0 {
            core::hint::spin_loop();
        }
    }
    for buf in all() {
        // SAFETY: released by `after_fork`.
        unsafe { buf.array.lock_raw() };
    }
}

/// After `fork()`, in parent and child: lifts the pauses; in the child, the tables of the
/// threads that did not survive the fork are flushed and retired.
///
/// # Safety
/// Only after [`before_fork`], on the thread that called it.
pub(crate) unsafe fn after_fork(child: bool) {
    for buf in all() {
        // SAFETY: taken by `before_fork` on this thread (or copied into the child).
        unsafe { buf.array.force_unlock() };
        buf.requests.fetch_sub(PAUSE, AcqRel);
    }
    // SAFETY: taken by `before_fork` on this thread (or copied into the child).
    unsafe { LIST.force_unlock() };
    if child {
        let me = super::guard::current_buffer();
        for buf in all() {
            if !ptr::eq(buf, me) && buf.owned.load(Acquire) {
                // Only this thread exists: writing another thread's table is safe now.
                buf.retire();
            }
        }
    }
}

/// A full memory barrier on every running thread of the process (registered for the fast
/// one at the first `fork()` with records on).
fn process_barrier() {
    crate::sync::prepare_process_barrier();
    crate::sync::process_barrier();
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashMap;

    /// A table of its own, outside the list (no other thread ever sees it).
    fn fresh() -> Buf {
        let buf = Buf::new();
        buf.install(new_slots(INITIAL).expect("memory"), INITIAL, 0);
        buf
    }

    /// Every live record of `buf`, as (addr, alloc) → size, through a reader's copy.
    fn contents(buf: &Buf) -> HashMap<(usize, u32), usize> {
        let _array = buf.array.lock();
        buf.read_with(|buf| {
            let v = buf.view();
            (0..=v.mask)
                .map(|i| v.slot(i))
                .filter(|s| {
                    Slot::occupied(s.addr.load(Acquire)) && s.meta.load(Relaxed) & DEAD == 0
                })
                .map(|s| {
                    let e = s.entry();
                    ((e.addr, e.alloc), e.size)
                })
                .collect()
        })
    }

    fn push(buf: &Buf, addr: usize, alloc: u32, size: usize) {
        assert!(
            buf.push(addr, alloc, size, size, 3) || buf.push_slow(addr, alloc, size, size, 3),
            "push of {addr:#x} refused"
        );
    }

    /// Addresses whose home slot is the same in a table of `cap` slots.
    fn colliding(cap: usize, n: usize) -> Vec<usize> {
        let shift = 64 - cap.trailing_zeros();
        let home = |a: usize| ((a as u64).wrapping_mul(HASH) >> shift) as usize;
        let target = home(0x1000 * 16);
        (1..10_000_000usize)
            .map(|k| 0x1000 * 16 + k * 16)
            .filter(|&a| home(a) == target)
            .take(n)
            .collect()
    }

    #[test]
    fn inserts_removes_and_collisions_keep_every_record() {
        let buf = fresh();
        let keys = colliding(INITIAL, 12);
        for (n, &a) in keys.iter().enumerate() {
            push(&buf, a, 1, 16 + n);
        }
        // The same address in another allocator is another record.
        push(&buf, keys[0], 2, 99);
        assert_eq!(buf.records(), 13);
        // Out of order: tombstones inside the run, empties at its end.
        for &k in &[3usize, 0, 11, 7, 1] {
            let e = buf.take_own(keys[k], 1).expect("found");
            assert_eq!((e.addr, e.size), (keys[k], 16 + k));
            assert!(buf.take_own(keys[k], 1).is_none(), "removed twice");
        }
        assert!(buf.forget_own(keys[0], 2));
        let c = contents(&buf);
        assert_eq!(c.len(), 7);
        for k in [2usize, 4, 5, 6, 8, 9, 10] {
            assert_eq!(c.get(&(keys[k], 1)), Some(&(16 + k)));
        }
        for k in [2usize, 4, 5, 6, 8, 9, 10] {
            assert!(buf.forget_own(keys[k], 1));
        }
        assert_eq!(buf.records(), 0);
        // Tombstones may be left; a rehash drops them.
        assert!(buf.rehash());
        assert_eq!(buf.used.load(Relaxed), 0);
        let t = buf.sites[0].totals();
        assert_eq!((t.total_blocks, t.max_blocks), (12, 12));
        assert_eq!(buf.sites[0].live_blocks.load(Relaxed), 0);
    }

    #[test]
    fn the_table_grows_and_sheds_tombstones() {
        let buf = fresh();
        let n = 1000;
        for i in 0..n {
            push(&buf, 0x10_0000 + i * 32, 4, 32);
        }
        assert!(buf.capacity() >= n * 8 / 5, "{}", buf.capacity());
        assert_eq!(contents(&buf).len(), n);
        // Churn over a steady live set: tombstones do not make the table grow again and
        // again (one more doubling at most, to be 3/8 full after a rehash).
        let cap = buf.capacity();
        for round in 0..20 * n {
            let i = (round * 7919) % n;
            assert!(buf.forget_own(0x10_0000 + i * 32, 4), "round {round}");
            push(&buf, 0x10_0000 + i * 32, 4, 32);
        }
        assert!(buf.capacity() <= 2 * cap, "{} from {cap}", buf.capacity());
        assert!(buf.used.load(Relaxed) < buf.limit.load(Relaxed));
        for i in 0..n {
            assert!(buf.forget_own(0x10_0000 + i * 32, 4));
        }
        assert_eq!(buf.records(), 0);
    }

    #[test]
    fn records_marked_dead_are_skipped_then_dropped() {
        let buf = fresh();
        for i in 0..100 {
            push(&buf, 0x20_0000 + i * 64, 1, 64);
        }
        {
            let _array = buf.array.lock();
            let e = buf.take_remote(0x20_0000 + 5 * 64, 1).expect("found");
            assert_eq!(e.size, 64);
            // Marked once: a second look finds nothing.
            assert!(buf.take_remote(0x20_0000 + 5 * 64, 1).is_none());
        }
        assert_eq!(buf.requests.load(Relaxed) & INBOX, INBOX);
        assert!(!contents(&buf).contains_key(&(0x20_0000 + 5 * 64, 1)));
        assert_eq!(buf.records(), 100, "dead, not yet dropped");
        // The owner's own free of a block at the same address (reused) is another record.
        push(&buf, 0x20_0000 + 5 * 64, 1, 48);
        assert_eq!(contents(&buf).get(&(0x20_0000 + 5 * 64, 1)), Some(&48));
        assert_eq!(buf.records(), 100, "the request served first");
        assert_eq!(buf.requests.load(Relaxed), 0);
        // An overflowing inbox: the owner scans.
        {
            let _array = buf.array.lock();
            for i in 10..10 + INBOX_KEYS + 5 {
                assert!(buf.take_remote(0x20_0000 + i * 64, 1).is_some());
            }
            assert!(buf.inbox.lock().overflow);
        }
        assert!(!buf.forget_own(0x20_0000 + 7 * 64, 1), "a request waits");
        assert!(buf.take_own(0x20_0000 + 7 * 64, 1).is_some());
        assert_eq!(buf.records(), 100 - INBOX_KEYS - 5 - 1);
        assert_eq!(contents(&buf).len(), 100 - INBOX_KEYS - 5 - 1);
    }

    #[test]
    fn a_free_on_another_thread_marks_the_record_and_exit_publishes_the_rest() {
        // An allocator index no real allocator has, so other tests never meet these keys.
        let alloc = 0xFFFF_0101;
        let (to_owner, owner_rx) = std::sync::mpsc::channel::<()>();
        let (to_main, main_rx) = std::sync::mpsc::channel::<usize>();
        let owner = std::thread::spawn(move || {
            let buf = claim(super::super::guard::thread_id()).expect("a table");
            for i in 0..1000 {
                push(buf, 0x7000_0000 + i * 16, alloc, 16);
            }
            to_main.send(ptr::from_ref(buf).addr()).unwrap();
            owner_rx.recv().unwrap();
            // Serves the inbox, then frees one of its own.
            assert!(buf.take_own(0x7000_0000 + 16, alloc).is_some());
            assert_eq!(buf.records(), 998);
            // Exit: the rest go to the shared table (the exit hook).
        });
        let me = main_rx.recv().unwrap() as *const Buf;
        let key = Key {
            addr: 0x7000_0000,
            alloc,
        };
        let rec = table::remove(key, || 0, ptr::null()).expect("found in the owner's table");
        assert_eq!(rec.size, 16);
        assert!(table::remove(key, || 0, ptr::null()).is_none());
        // Not found when the owner's table is the one skipped.
        let other = Key {
            addr: 0x7000_0000 + 32,
            alloc,
        };
        assert!(table::remove(other, || 0, me).is_none());
        to_owner.send(()).unwrap();
        owner.join().unwrap();
        assert_eq!(table::totals_of(alloc), (998, 998 * 16, 998 * 16));
        for i in 2..1000 {
            let key = Key {
                addr: 0x7000_0000 + i * 16,
                alloc,
            };
            assert!(table::remove(key, || 0, ptr::null()).is_some(), "{i}");
        }
        assert_eq!(table::totals_of(alloc), (0, 0, 0));
    }

    #[derive(Clone, Debug)]
    enum Op {
        Insert(u16, u8, u16),
        Remove(u16, u8),
        Dead(u16, u8),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            3 => (0u16..600, 0u8..3, 1u16..500).prop_map(|(a, k, s)| Op::Insert(a, k, s)),
            2 => (0u16..600, 0u8..3).prop_map(|(a, k)| Op::Remove(a, k)),
            1 => (0u16..600, 0u8..3).prop_map(|(a, k)| Op::Dead(a, k)),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        /// The table against a shadow map under random inserts, removes (by the owner and
        /// by other threads' marks), with collisions, growth and rehashes.
        #[test]
        fn the_table_matches_a_shadow_map(ops in proptest::collection::vec(op(), 1..3000)) {
            let buf = fresh();
            let mut shadow: HashMap<(usize, u32), usize> = HashMap::new();
            // Few distinct addresses, multiples of 16: clusters form.
            let addr = |a: u16| 0x40_0000 + usize::from(a) * 16;
            for op in ops {
                match op {
                    Op::Insert(a, k, size) => {
                        let key = (addr(a), u32::from(k));
                        if let std::collections::hash_map::Entry::Vacant(v) = shadow.entry(key) {
                            push(&buf, key.0, key.1, usize::from(size));
                            v.insert(usize::from(size));
                        }
                    }
                    Op::Remove(a, k) => {
                        let key = (addr(a), u32::from(k));
                        let taken = buf.take_own(key.0, key.1).map(|e| e.size);
                        prop_assert_eq!(taken, shadow.remove(&key));
                    }
                    Op::Dead(a, k) => {
                        let key = (addr(a), u32::from(k));
                        let _array = buf.array.lock();
                        let taken = buf.take_remote(key.0, key.1).map(|e| e.size);
                        prop_assert_eq!(taken, shadow.remove(&key));
                    }
                }
                prop_assert!(buf.used.load(Relaxed) <= buf.limit.load(Relaxed));
            }
            prop_assert_eq!(contents(&buf), shadow.clone());
            let mut live = [0u64; SITES];
            for (&(_, k), &size) in &shadow {
                let j = buf.sites.iter().position(|s| s.alloc.load(Relaxed) == k).unwrap();
                live[j] += size as u64;
            }
            buf.serve();
            for (site, want) in buf.sites.iter().zip(live) {
                prop_assert_eq!(site.live_bytes.load(Relaxed), want);
            }
            prop_assert_eq!(buf.records(), shadow.len());
        }
    }
}
