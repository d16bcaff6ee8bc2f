//! Per-thread record buffers: each thread's newest basic records, written by that thread
//! alone, so that a block allocated and freed on the same thread never reaches the shared
//! table (no lock, no atomic read-modify-write, no clock read for most records).
//!
//! A buffer holds up to [`CAP`] records in a plain array (newest last) plus per-allocator
//! totals. When it is full, when its thread exits, and before a `fork()` child adopts it,
//! its records move to the shared [`table`](super::table).
//!
//! Other threads read a buffer through a sequence lock on its departures: the owner makes
//! `seq` odd while it removes or moves records and even after; a reader retries when `seq`
//! moved (after a few tries it asks the owner to pause at its next call, so a busy owner
//! cannot starve it). A new record only appends: its slot is written before the length
//! that shows it (a release store), and slots below the length change only in departures,
//! so pushes leave `seq` alone. Every field is an atomic accessed with relaxed loads and
//! stores (the length with release and acquire), which are plain moves on x86-64.
//!
//! The owner's common cases (a push with room, a free of a record the newest slot or the
//! address index finds) call nothing, so the allocator paths that inline them need no saved
//! registers; anything else (a request to serve, a full buffer, a scan) returns to a slower
//! path that does it.
//!
//! Exactness with cross-thread frees: a free whose record is not in its own thread's buffer
//! takes the record's shard lock and looks in the shared table, then in every other buffer.
//! It cannot remove a record from another thread's buffer, so it marks it dead in that
//! buffer's inbox (and sets a flag the owner tests on every call); the owner drops its dead
//! records before its next record operation. A record moves from a buffer to the table only
//! under its shard lock, after its owner checked the inbox flag under that lock, so a free
//! never misses a record in flight and a dead record is never published. Readers (reports,
//! [`live_totals`](super::live_totals)) hold every shard lock, copy the inboxes, then the
//! buffers, and skip the dead records.
//!
//! Lock order: buffer list → shard locks → inboxes → the records' heap. An owner never waits
//! for anything while its `seq` is odd, so a reader holding locks and waiting for an even
//! `seq` always gets it.

use super::table::{self, Key, Rec};
use crate::sync::SpinLock;
use core::alloc::Layout;
use core::ptr;
use core::sync::atomic::{
    AtomicBool, AtomicPtr, AtomicU8, AtomicU32, AtomicU64, AtomicUsize, Ordering::*,
    compiler_fence, fence,
};

/// Records per buffer. The scans are linear, so small; 64 holds the `small` workload's
/// batches of 32.
pub(crate) const CAP: usize = 64;
/// Buckets of a buffer's address index (four times the records, so few collide: a free
/// whose record the index lost takes the slow path and scans).
const INDEX: usize = 4 * CAP;
const _: () = assert!(INDEX.is_power_of_two() && CAP < u8::MAX as usize);

/// The index bucket of `addr`.
#[inline(always)]
fn bucket(addr: usize) -> usize {
    (addr as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) as usize
        >> (usize::BITS - INDEX.trailing_zeros())
}

/// Bits of a buffer's membership summary: a bit per hash of the addresses buffered since
/// the last rebuild, so that a free whose record is not here (a block older than the
/// buffer, whose record is in the table) learns it without scanning.
const SUMMARY_BITS: usize = 1024;

/// The summary bit of `addr` (other bits of the product than [`bucket`]'s).
#[inline(always)]
fn summary_bit(addr: usize) -> usize {
    ((addr as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 32) as usize % SUMMARY_BITS
}

/// Allocators with per-thread totals per buffer (records of a fifth go to the table).
const SITES: usize = 4;
/// Where a record's site slot sits in its meta word: the top bits, so a shift alone finds
/// it.
const SLOT_SHIFT: u32 = 64 - SITES.trailing_zeros();
const _: () = assert!(SITES.is_power_of_two());
/// A buffered record's time is the clock read at the last flush, or at a departure (a
/// record freed or moved out of the buffer) about this many departures earlier on the same
/// thread: a clock read costs as much as the rest of the record. (Between two departures a
/// thread buffers at most [`CAP`] records.)
const TICK_EVERY: u64 = 32;

/// `requests`: dead records wait in the inbox.
const INBOX: u32 = 1;
/// `requests`: one reader asks the owner to pause (a count, in these units).
const PAUSE: u32 = 2;

/// [`Site::live`] holds the live bytes above these bits and the live blocks in them (a
/// buffer holds fewer than 256 records; its live bytes stay far below 2^56).
const BLOCK_BITS: u32 = 8;
const _: () = assert!(CAP < 1 << BLOCK_BITS);

/// A record of `size` bytes in [`Site::live`]'s packing.
#[inline(always)]
fn packed(size: usize) -> u64 {
    (size as u64) << BLOCK_BITS | 1
}

/// A buffer's totals for one allocator. The live bytes and blocks are packed in one word so
/// that a record adds and removes both with one add. The most live at once is checked as
/// records leave (a peak is always followed by a departure, or still there when read), in
/// the same packing: the bytes decide, the blocks come along.
#[repr(align(64))]
struct Site {
    /// Registry index, or `u32::MAX` while unused.
    alloc: AtomicU32,
    total_bytes: AtomicU64,
    total_blocks: AtomicU64,
    live: AtomicU64,
    max: AtomicU64,
}

impl Site {
    /// A record of `size` bytes, `packed` as [`packed`] makes it, comes in.
    #[inline(always)]
    fn added(&self, size: usize, packed: u64) {
        add(&self.total_bytes, size as u64);
        add(&self.total_blocks, 1);
        add(&self.live, packed);
    }

    /// A record of `packed` size ([`packed`]) leaves: the live bytes before it left may be
    /// the most so far.
    #[inline(always)]
    fn left(&self, packed: u64) {
        let live = self.live.load(Relaxed);
        if live > self.max.load(Relaxed) {
            self.max.store(live, Relaxed);
        }
        self.live.store(live.wrapping_sub(packed), Relaxed);
    }

    /// The totals, with the live bytes now counted towards the most at once.
    fn totals(&self) -> SiteTotals {
        let max = self.max.load(Relaxed).max(self.live.load(Relaxed));
        SiteTotals {
            alloc: self.alloc.load(Relaxed),
            total_bytes: self.total_bytes.load(Relaxed),
            total_blocks: self.total_blocks.load(Relaxed),
            max_bytes: max >> BLOCK_BITS,
            max_blocks: max & ((1 << BLOCK_BITS) - 1),
        }
    }

    /// Back to unused (its buffer retires).
    fn clear(&self) {
        for a in [&self.total_bytes, &self.total_blocks, &self.live, &self.max] {
            a.store(0, Relaxed);
        }
        self.alloc.store(u32::MAX, Relaxed);
    }

    const fn new() -> Self {
        Self {
            alloc: AtomicU32::new(u32::MAX),
            total_bytes: AtomicU64::new(0),
            total_blocks: AtomicU64::new(0),
            live: AtomicU64::new(0),
            max: AtomicU64::new(0),
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

/// Dead records: keys of records in the buffer whose blocks another thread freed.
struct Inbox {
    len: usize,
    keys: [(usize, u32); CAP],
}

impl Inbox {
    fn contains(&self, addr: usize, alloc: u32) -> bool {
        self.keys[..self.len].contains(&(addr, alloc))
    }
}

/// One buffered record as a reader or the owner copies it out.
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

/// One thread's buffer (see the [module docs](self)). Allocated from the records' heap,
/// never freed: a retired buffer is reused by the next new thread.
#[repr(C, align(128))]
pub(crate) struct Buf {
    seq: AtomicU64,
    len: AtomicUsize,
    requests: AtomicU32,
    tid: AtomicU32,
    /// The last clock read (owner only).
    tick: AtomicU64,
    addrs: [AtomicUsize; CAP],
    /// Owner-only hint: for a hash of an address, the slot (plus one) of the record last
    /// buffered there, so a free finds its record without scanning. Checked against
    /// `addrs` before use, so a stale or overwritten entry only costs the scan.
    index: [AtomicU8; INDEX],
    /// Owner-only: the [`summary_bit`] of every record in the buffer is set (and of some
    /// that left since the last rebuild), so a clear bit means "not here".
    summary: [AtomicU64; SUMMARY_BITS / 64],
    /// Allocator index, the alignment's log2 in bits 32..40, the site slot from bit
    /// [`SLOT_SHIFT`] up.
    metas: [AtomicU64; CAP],
    /// Granted sizes as [`packed`] makes them, ready for the site's live total.
    sizes: [AtomicU64; CAP],
    requested: [AtomicUsize; CAP],
    times: [AtomicU64; CAP],
    sites: [Site; SITES],
    inbox: SpinLock<Inbox>,
    /// Whether a live thread owns it.
    owned: AtomicBool,
    next: AtomicPtr<Buf>,
}

/// Every buffer ever made (a list that only grows; readers walk it without a lock).
static HEAD: AtomicPtr<Buf> = AtomicPtr::new(ptr::null_mut());
/// Serialises claims (and is held across `fork()`).
static LIST: SpinLock<()> = SpinLock::new(());

impl Buf {
    const fn new() -> Self {
        Self {
            seq: AtomicU64::new(0),
            len: AtomicUsize::new(0),
            requests: AtomicU32::new(0),
            tid: AtomicU32::new(0),
            tick: AtomicU64::new(0),
            addrs: [const { AtomicUsize::new(0) }; CAP],
            index: [const { AtomicU8::new(0) }; INDEX],
            summary: [const { AtomicU64::new(0) }; SUMMARY_BITS / 64],
            metas: [const { AtomicU64::new(0) }; CAP],
            sizes: [const { AtomicU64::new(0) }; CAP],
            requested: [const { AtomicUsize::new(0) }; CAP],
            times: [const { AtomicU64::new(0) }; CAP],
            sites: [const { Site::new() }; SITES],
            inbox: SpinLock::new(Inbox {
                len: 0,
                keys: [(0, 0); CAP],
            }),
            owned: AtomicBool::new(false),
            next: AtomicPtr::new(ptr::null_mut()),
        }
    }

    // ---- The owner's side. ----

    /// Reads the clock for the records buffered from now on.
    #[cold]
    #[inline(never)]
    fn read_clock(&self) {
        self.tick.store(super::clock::ticks(), Relaxed);
    }

    /// Starts a write that moves or removes records: `seq` odd. `None` (and `seq` even
    /// again, nothing written) when a request is pending: serve it and retry.
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
        let mut keys = [(0usize, 0u32); CAP];
        let n = {
            let mut inbox = self.inbox.lock();
            let n = inbox.len;
            keys[..n].copy_from_slice(&inbox.keys[..n]);
            inbox.len = 0;
            self.requests.fetch_and(!INBOX, AcqRel);
            n
        };
        for &(addr, alloc) in &keys[..n] {
            let s = self.begin_anyway();
            if let Some(i) = self.find(addr, alloc) {
                self.remove_at(i);
            }
            self.end(s);
        }
    }

    /// The slot of a record (owner only: reads its own writes).
    #[inline(always)]
    fn find(&self, addr: usize, alloc: u32) -> Option<usize> {
        if let Some(i) = self.find_fast(addr, alloc) {
            return Some(i);
        }
        if !self.maybe_here(addr) {
            return None;
        }
        self.scan(addr, alloc, self.len.load(Relaxed))
    }

    /// Whether a record of `addr` may be in the buffer (`false`: certainly not).
    #[inline(always)]
    fn maybe_here(&self, addr: usize) -> bool {
        let bit = summary_bit(addr);
        self.summary[bit / 64].load(Relaxed) & 1 << (bit % 64) != 0
    }

    /// Notes `addr` in the summary.
    #[inline(always)]
    fn note(&self, addr: usize) {
        let bit = summary_bit(addr);
        let word = &self.summary[bit / 64];
        word.store(word.load(Relaxed) | 1 << (bit % 64), Relaxed);
    }

    /// The slot of a record the newest slot or the index knows (calls nothing). The newest
    /// first: most blocks are freed right after they were allocated, or in reverse order.
    #[inline(always)]
    fn find_fast(&self, addr: usize, alloc: u32) -> Option<usize> {
        self.find_fast_in(addr, alloc, self.len.load(Relaxed))
    }

    /// [`find_fast`](Self::find_fast) among the first `len` slots.
    #[inline(always)]
    fn find_fast_in(&self, addr: usize, alloc: u32, len: usize) -> Option<usize> {
        if len == 0 {
            return None;
        }
        let last = (len - 1) % CAP;
        if self.addrs[last].load(Relaxed) == addr && self.alloc_at(last) == alloc {
            return Some(last);
        }
        let hint = self.index[bucket(addr)].load(Relaxed) as usize;
        if hint != 0
            && hint <= len
            && self.addrs[(hint - 1) % CAP].load(Relaxed) == addr
            && self.alloc_at((hint - 1) % CAP) == alloc
        {
            return Some(hint - 1);
        }
        None
    }

    /// [`find`](Self::find) when the newest slot and the index do not know the record.
    #[cold]
    #[inline(never)]
    fn scan(&self, addr: usize, alloc: u32, len: usize) -> Option<usize> {
        let found = (0..len.min(CAP))
            .rev()
            .find(|&i| self.addrs[i].load(Relaxed) == addr && self.alloc_at(i) == alloc);
        if found.is_none() {
            // The summary said "maybe" for a record that left: rebuild it from the
            // records here, so bits of departed records stop costing scans.
            let mut words = [0u64; SUMMARY_BITS / 64];
            for a in &self.addrs[..len.min(CAP)] {
                let bit = summary_bit(a.load(Relaxed));
                words[bit / 64] |= 1 << (bit % 64);
            }
            for (word, w) in self.summary.iter().zip(words) {
                word.store(w, Relaxed);
            }
        }
        found
    }

    #[inline(always)]
    fn alloc_at(&self, i: usize) -> u32 {
        self.metas[i].load(Relaxed) as u32
    }

    #[inline(always)]
    fn entry_at(&self, i: usize) -> Entry {
        let meta = self.metas[i].load(Relaxed);
        Entry {
            addr: self.addrs[i].load(Relaxed),
            alloc: meta as u32,
            size: (self.sizes[i].load(Relaxed) >> BLOCK_BITS) as usize,
            requested: self.requested[i].load(Relaxed),
            time: self.times[i].load(Relaxed),
            align_log2: (meta >> 32) as u8,
        }
    }

    /// Removes slot `i` (the last record moves into it) and takes it off its site's live
    /// totals. Inside a write.
    #[inline(always)]
    fn remove_at(&self, i: usize) -> Entry {
        let e = self.entry_at(i);
        self.drop_at(i);
        e
    }

    /// Removes slot `i` without reading it out. Inside a write. The index keeps pointing
    /// at the emptied slot: every hint is checked against `addrs` before use.
    #[inline(always)]
    fn drop_at(&self, i: usize) {
        self.drop_in(i, self.len.load(Relaxed));
    }

    /// [`drop_at`](Self::drop_at) with the length as the caller read it.
    #[inline(always)]
    fn drop_in(&self, i: usize, len: usize) {
        let i = i % CAP;
        self.drop_known(i, self.metas[i].load(Relaxed), len.wrapping_sub(1) % CAP);
    }

    /// [`drop_in`](Self::drop_in) with slot `i`'s meta word already read, and the last slot.
    #[inline(always)]
    fn drop_known(&self, i: usize, meta: u64, last: usize) {
        self.sites[(meta >> SLOT_SHIFT) as usize % SITES].left(self.sizes[i].load(Relaxed));
        if i != last {
            self.move_last(i, last);
        }
        self.len.store(last, Relaxed);
    }

    /// Moves the last record into slot `i`, keeping its index hint. Inside a write.
    #[inline(always)]
    fn move_last(&self, i: usize, last: usize) {
        let moved = self.addrs[last].load(Relaxed);
        let hint = &self.index[bucket(moved)];
        if hint.load(Relaxed) as usize == last + 1 {
            hint.store((i + 1) as u8, Relaxed);
        }
        self.addrs[i].store(moved, Relaxed);
        self.metas[i].store(self.metas[last].load(Relaxed), Relaxed);
        self.sizes[i].store(self.sizes[last].load(Relaxed), Relaxed);
        self.requested[i].store(self.requested[last].load(Relaxed), Relaxed);
        self.times[i].store(self.times[last].load(Relaxed), Relaxed);
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

    /// Buffers a new record if that takes no more than appending (calls nothing); `false`:
    /// the buffer is full, a request waits, or the allocator is not the first site's (see
    /// [`push_slow`](Self::push_slow)).
    ///
    /// A push only appends: it writes the slot past the last record and then the length
    /// (a release store), so readers never see it half written and `seq` stays as it is.
    /// Its time is the clock read at the last departure that read it (see
    /// [`TICK_EVERY`]), or at the last flush.
    #[inline(always)]
    pub(crate) fn push(
        &self,
        addr: usize,
        alloc: u32,
        size: usize,
        requested: usize,
        align_log2: u8,
    ) -> bool {
        let len = self.len.load(Relaxed);
        // One test for all three ways off the fast path: a full buffer, a request (dead
        // records are dropped before a record that may reuse their address comes in), an
        // allocator other than the first site's.
        if len < CAP
            && self.requests.load(Relaxed) == 0
            && self.sites[0].alloc.load(Relaxed) == alloc
        {
            self.append(len, 0, addr, alloc, size, requested, align_log2);
            return true;
        }
        false
    }

    /// Buffers a new record, serving requests and flushing a full buffer first; `false`
    /// when it cannot (no site left for its allocator): record it in the table instead.
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
            let len = self.len.load(Relaxed);
            if len >= CAP {
                self.flush();
                continue;
            }
            let Some(slot) = self.site_for(alloc) else {
                return false;
            };
            self.append(len, slot, addr, alloc, size, requested, align_log2);
            return true;
        }
    }

    /// Writes a record into slot `len` and then the length. The site's totals count it
    /// first, so a copy taken into a `fork()` child never has a record its totals miss.
    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    fn append(
        &self,
        len: usize,
        slot: usize,
        addr: usize,
        alloc: u32,
        size: usize,
        requested: usize,
        align_log2: u8,
    ) {
        let i = len % CAP;
        self.addrs[i].store(addr, Relaxed);
        self.index[bucket(addr)].store((i + 1) as u8, Relaxed);
        self.note(addr);
        let meta = u64::from(alloc) | u64::from(align_log2) << 32 | (slot as u64) << SLOT_SHIFT;
        self.metas[i].store(meta, Relaxed);
        let packed = packed(size);
        self.sizes[i].store(packed, Relaxed);
        self.requested[i].store(requested, Relaxed);
        self.times[i].store(self.tick.load(Relaxed), Relaxed);
        self.sites[slot % SITES].added(size, packed);
        self.len.store(i + 1, Release);
    }

    /// Takes this thread's own record of a block out of the buffer (its realloc), if it is
    /// here.
    pub(crate) fn take_own(&self, addr: usize, alloc: u32) -> Option<Entry> {
        if !self.maybe_here(addr) {
            // Certainly not here (the summary has every buffered record's bit), whatever a
            // pending request would drop: the table or another buffer has it.
            return None;
        }
        let (s, i) = self.find_own(addr, alloc)?;
        let e = self.remove_at(i);
        self.end(s);
        Some(e)
    }

    /// Drops this thread's own record of a freed block if the newest slot or the index
    /// finds it and no request waits (calls nothing); `false` otherwise (then
    /// [`take_own`](Self::take_own) serves the request and looks everywhere).
    #[inline(always)]
    pub(crate) fn forget_own(&self, addr: usize, alloc: u32) -> bool {
        let Some(s) = self.begin() else {
            return false;
        };
        let len = self.len.load(Relaxed);
        if len == 0 {
            self.abandon(s);
            return false;
        }
        // The newest record first, as in `find_fast`, keeping its meta word.
        let last = (len - 1) % CAP;
        let meta = self.metas[last].load(Relaxed);
        let (i, meta) = if self.addrs[last].load(Relaxed) == addr && meta as u32 == alloc {
            (last, meta)
        } else if let Some(i) = self.find_fast_in(addr, alloc, len) {
            let i = i % CAP;
            (i, self.metas[i].load(Relaxed))
        } else {
            self.abandon(s);
            return false;
        };
        self.tick_at(s);
        self.drop_known(i, meta, last);
        // `seq` read again rather than kept: the caller's fast path has few registers to
        // spare while a record moves.
        self.seq.store(self.seq.load(Relaxed) + 1, Release);
        true
    }

    /// Starts a write and finds the slot of one of this thread's records (`None`: not
    /// here, nothing started). Reads the clock every [`TICK_EVERY`] departures.
    #[inline(always)]
    fn find_own(&self, addr: usize, alloc: u32) -> Option<(u64, usize)> {
        let Some(s) = self.begin() else {
            return self.find_own_served(addr, alloc);
        };
        self.found(s, addr, alloc)
    }

    /// [`find_own`](Self::find_own) once the write started.
    #[inline(always)]
    fn found(&self, s: u64, addr: usize, alloc: u32) -> Option<(u64, usize)> {
        let Some(i) = self.find(addr, alloc) else {
            self.abandon(s);
            return None;
        };
        self.tick_at(s);
        Some((s, i))
    }

    /// Reads the clock at every [`TICK_EVERY`]th write (`seq` goes up by 2 per write, so it
    /// passes every multiple).
    #[inline(always)]
    fn tick_at(&self, s: u64) {
        if s % (2 * TICK_EVERY) == 0 {
            self.tick.store(super::clock::ticks(), Relaxed);
        }
    }

    /// [`find_own`](Self::find_own) after serving a request.
    #[cold]
    #[inline(never)]
    fn find_own_served(&self, addr: usize, alloc: u32) -> Option<(u64, usize)> {
        loop {
            self.serve();
            if let Some(s) = self.begin() {
                return self.found(s, addr, alloc);
            }
        }
    }

    /// Moves every record to the shared table (the buffer is full, or its thread exits, or
    /// its thread is gone after a `fork()`).
    #[cold]
    #[inline(never)]
    pub(crate) fn flush(&self) {
        let thread = self.tid.load(Relaxed);
        loop {
            if self.requests.load(Acquire) & INBOX != 0 {
                self.drain();
            }
            let len = self.len.load(Relaxed);
            if len == 0 {
                // The records buffered next get a fresh time.
                self.read_clock();
                return;
            }
            let e = self.entry_at(len - 1);
            let published = table::publish_with(e.key(), e.rec(thread), || {
                // Under the record's shard lock: a free that marked a record dead did so
                // under the same lock, so its flag shows here; without it, the record is
                // alive and leaves the buffer for the table.
                if self.requests.load(Acquire) & INBOX != 0 {
                    return false;
                }
                let s = self.begin_anyway();
                self.remove_at(len - 1);
                self.end(s);
                true
            });
            // Not published: a record was marked dead meanwhile; drain and go on.
            let _ = published;
        }
    }

    /// Moves the records to the table and the totals into the table's sites, and gives
    /// the buffer up for another thread.
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
        self.owned.store(false, Release);
    }

    // ---- Other threads' side. ----

    /// A consistent copy of the records and site totals (retrying while the owner writes).
    /// Returns the record count.
    fn read(&self, out: &mut [Entry; CAP], sites: &mut [SiteTotals; SITES]) -> usize {
        self.read_with(|buf| {
            let len = buf.len.load(Acquire).min(CAP);
            for (i, slot) in out.iter_mut().enumerate().take(len) {
                *slot = buf.entry_at(i);
            }
            for (site, t) in buf.sites.iter().zip(sites.iter_mut()) {
                *t = site.totals();
            }
            len
        })
    }

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
    /// under the record's shard lock.
    fn take_remote(&self, addr: usize, alloc: u32) -> Option<Entry> {
        let found = self.read_with(|buf| {
            let len = buf.len.load(Acquire).min(CAP);
            (0..len)
                .rev()
                .find(|&i| buf.addrs[i].load(Relaxed) == addr && buf.alloc_at(i) == alloc)
                .map(|i| buf.entry_at(i))
        })?;
        let mut inbox = self.inbox.lock();
        if inbox.contains(addr, alloc) {
            return None; // already dead: a block reused at this address lives elsewhere
        }
        let n = inbox.len;
        inbox.keys[n] = (addr, alloc);
        inbox.len = n + 1;
        self.requests.fetch_or(INBOX, AcqRel);
        Some(found)
    }
}

#[inline(always)]
fn add(a: &AtomicU64, n: u64) {
    a.store(a.load(Relaxed).wrapping_add(n), Relaxed);
}

/// Every buffer, in list order.
fn all() -> impl Iterator<Item = &'static Buf> {
    let mut p = HEAD.load(Acquire);
    core::iter::from_fn(move || {
        // SAFETY: buffers are never freed; list nodes are published with release stores.
        let buf = unsafe { p.as_ref()? };
        p = buf.next.load(Acquire);
        Some(buf)
    })
}

/// Whether any thread ever buffered records (before that, a table miss is final).
#[inline]
fn any() -> bool {
    !HEAD.load(Relaxed).is_null()
}

/// Finds `key`'s record in another thread's buffer, marks it dead there and returns it.
/// Called under the key's shard lock, after the table missed. `me` is the caller's buffer
/// (already searched).
pub(crate) fn take_from_others(key: Key, me: *const Buf) -> Option<Rec> {
    if !any() {
        return None;
    }
    for buf in all() {
        if ptr::eq(buf, me) || buf.len.load(Acquire) == 0 {
            continue;
        }
        if let Some(e) = buf.take_remote(key.addr, key.alloc) {
            return Some(e.rec(buf.tid.load(Relaxed)));
        }
    }
    None
}

/// Claims a buffer for the calling thread (a retired one, or a new one on the records'
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
                let block = super::heap::RECORDS_HEAP.allocate(Layout::new::<Buf>())?;
                let p: *mut Buf = block.ptr.as_ptr().cast();
                // SAFETY: the block is fresh, sized and aligned for a `Buf` (the heap honours
                // the layout's alignment), and written before it is shared.
                unsafe {
                    p.write(Buf::new());
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
    // SAFETY: the key exists; the value is the thread's buffer, handed to `on_thread_exit`.
    unsafe { libc::pthread_setspecific(key, ptr::from_ref(buf).cast()) };
    Some(buf)
}

static EXIT_KEY: AtomicU64 = AtomicU64::new(u64::MAX);
static EXIT_KEY_LOCK: SpinLock<()> = SpinLock::new(());

/// The pthread key whose destructor retires a thread's buffer (created once).
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
/// thread go straight to the table.
unsafe extern "C" fn on_thread_exit(buf: *mut libc::c_void) {
    super::guard::buffer_gone();
    // SAFETY: the value set by `claim`: this thread's buffer, never freed.
    let buf = unsafe { &*buf.cast::<Buf>() };
    buf.retire();
}

/// Copies every thread's live buffered records and totals (dead ones left out).
/// The caller holds every shard lock, so no record enters or leaves a buffer through the
/// table meanwhile.
pub(crate) fn copy_all(
    mut record: impl FnMut(Key, Rec),
    mut site: impl FnMut(SiteTotals, u64, u64),
) {
    if !any() {
        return;
    }
    let mut entries = [Entry {
        addr: 0,
        alloc: 0,
        size: 0,
        requested: 0,
        time: 0,
        align_log2: 0,
    }; CAP];
    for buf in all() {
        if !buf.owned.load(Acquire) {
            continue;
        }
        // The inbox before the records: a record dropped by its owner meanwhile is gone
        // from both, one marked dead meanwhile cannot be (that needs a shard lock).
        let (dead_len, dead) = {
            let inbox = buf.inbox.lock();
            (inbox.len, inbox.keys)
        };
        let dead = &dead[..dead_len];
        let mut sites = [SiteTotals::default(); SITES];
        let len = buf.read(&mut entries, &mut sites);
        let thread = buf.tid.load(Relaxed);
        let mut live = [(0u64, 0u64); SITES];
        for e in &entries[..len] {
            if dead.contains(&(e.addr, e.alloc)) {
                continue;
            }
            record(e.key(), e.rec(thread));
            if let Some(j) = sites.iter().position(|s| s.alloc == e.alloc) {
                live[j].0 += e.size as u64;
                live[j].1 += 1;
            }
        }
        for (s, (bytes, blocks)) in sites.into_iter().zip(live) {
            if s.alloc != u32::MAX {
                site(s, bytes, blocks);
            }
        }
    }
}

// ---- fork() ----

/// Before `fork()` (after the table's locks): holds every owner at the start of its next
/// departure, so no buffer is copied into the child half written (a push in flight is
/// invisible there until its length store, and its site totals may count it: the block is
/// allocated all the same).
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
}

/// After `fork()`, in parent and child: lifts the pauses; in the child, the buffers of the
/// threads that did not survive the fork are flushed and retired.
///
/// # Safety
/// Only after [`before_fork`], on the thread that called it.
pub(crate) unsafe fn after_fork(child: bool) {
    for buf in all() {
        buf.requests.fetch_sub(PAUSE, AcqRel);
    }
    // SAFETY: taken by `before_fork` on this thread (or copied into the child).
    unsafe { LIST.force_unlock() };
    if child {
        let me = super::guard::current_buffer();
        for buf in all() {
            if !ptr::eq(buf, me) && buf.owned.load(Acquire) {
                // Only this thread exists: writing another thread's buffer is safe now.
                buf.retire();
            }
        }
    }
}

const MEMBARRIER_CMD_GLOBAL: libc::c_long = 1;
const MEMBARRIER_CMD_PRIVATE_EXPEDITED: libc::c_long = 8;
const MEMBARRIER_CMD_REGISTER_PRIVATE_EXPEDITED: libc::c_long = 16;

/// Registers for the fast process-wide barrier, once (at the first `fork()` with records
/// on: registering can take milliseconds, which no allocation should wait for). Returns
/// whether the fast barrier is available.
fn expedited_barrier() -> bool {
    static STATE: AtomicU32 = AtomicU32::new(0); // 0: not tried, 1: available, 2: not
    match STATE.load(Acquire) {
        1 => return true,
        2 => return false,
        _ => {}
    }
    #[cfg(all(target_os = "linux", not(miri)))]
    // SAFETY: membarrier takes plain integers and touches no memory of ours.
    let ok = unsafe {
        libc::syscall(
            libc::SYS_membarrier,
            MEMBARRIER_CMD_REGISTER_PRIVATE_EXPEDITED,
            0,
        )
    } == 0;
    #[cfg(not(all(target_os = "linux", not(miri))))]
    let ok = false;
    STATE.store(if ok { 1 } else { 2 }, Release);
    ok
}

/// A full memory barrier on every running thread of the process (Linux `membarrier`).
fn process_barrier() {
    #[cfg(all(target_os = "linux", not(miri)))]
    {
        let cmd = if expedited_barrier() {
            MEMBARRIER_CMD_PRIVATE_EXPEDITED
        } else {
            MEMBARRIER_CMD_GLOBAL
        };
        // SAFETY: as in `expedited_barrier`.
        unsafe { libc::syscall(libc::SYS_membarrier, cmd, 0) };
    }
    fence(SeqCst);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The owner's lookups against a shadow set: a record pushed is found until it leaves,
    /// and an address never pushed (or gone) is not, through the index, the summary and
    /// the scan with its rebuilds. Kept below `CAP` records, so nothing reaches the shared
    /// table.
    #[test]
    fn lookups_find_exactly_the_buffered_records() {
        let buf = Buf::new();
        let mut live: Vec<usize> = Vec::new();
        let mut rng = 0x2545_F491_4F6C_DD1Du64;
        let mut next = || {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng
        };
        for step in 0..20_000 {
            let r = next();
            // Addresses from a small range, so the same ones come back after they left.
            let addr = 0x10_0000 + (r as usize % 512) * 16;
            let here = live.contains(&addr);
            if r % 3 != 0 && !here && live.len() < CAP - 1 {
                let size = 16 + (r as usize >> 20) % 256;
                assert!(
                    buf.push(addr, 7, size, size, 3) || buf.push_slow(addr, 7, size, size, 3),
                    "step {step}: push refused"
                );
                live.push(addr);
            } else {
                let taken = buf.take_own(addr, 7);
                assert_eq!(taken.is_some(), here, "step {step}: {addr:#x}");
                if let Some(e) = taken {
                    assert_eq!(e.addr, addr);
                    live.retain(|&a| a != addr);
                }
            }
            assert_eq!(buf.len.load(Relaxed), live.len());
            for &a in &live {
                assert!(buf.maybe_here(a), "step {step}: summary lost {a:#x}");
            }
        }
        // Another allocator's record of the same address is another record.
        if let Some(&a) = live.first() {
            assert!(buf.take_own(a, 8).is_none());
        }
    }
}
