//! The shared record table: every live record that is not in a thread's own record table
//! (see [`buffer`]: records of threads that exited, sampled and full records, records of a
//! fifth allocator on one thread or made when the records' heap was short), keyed by
//! (address, allocator), in 64 shards.
//!
//! Each shard is a `hashbrown` map behind an allocation-free [`SpinLock`], on a cache line
//! of its own; the shard is chosen by a hash of the address, so threads recording unrelated
//! blocks rarely meet on a lock. The maps allocate from the records' own heap
//! ([`Internal`]), never from the global allocator, and only with `try_reserve`: when that
//! heap is out of memory a record is dropped (and counted), the program goes on.
//!
//! Each shard also keeps per-call-site totals for the records it saw (bytes and blocks
//! allocated, live, the most live at once, lifetimes of freed blocks), updated under the
//! same lock, so the DHAT profile has totals for blocks that are long gone.
//!
//! A sampled record also bumps a counter in [`FILTER`], indexed by its address's 16-byte granule within
//! a 1 MiB window.
//! A free in an allocator that only samples checks that counter first and skips the table
//! when it is zero, which it is for nearly every block.
//!
//! No lock here is ever held while calling anything that could allocate through the global
//! allocator, so recording cannot deadlock with the allocator it records.

use super::buffer::{self, Buf, SiteTotals};
use super::heap::Internal;
use super::map::{AddrMap, hash_parts};
use crate::sync::{SpinGuard, SpinLock};
use allocator_api2::vec::Vec as IVec;
use core::hash::{BuildHasher, Hasher};
use core::sync::atomic::{AtomicU8, AtomicU64, Ordering::Relaxed};
use hashbrown::{HashMap, HashTable};

const SHARDS: usize = 64;

/// A record's key: the block's address in one allocator.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct Key {
    pub(crate) addr: usize,
    /// The allocator's registry index.
    pub(crate) alloc: u32,
}

/// One live record.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Rec {
    /// Granted bytes.
    pub(crate) size: usize,
    /// Requested bytes.
    pub(crate) requested: usize,
    /// Tick count at allocation.
    pub(crate) time: u64,
    /// Blocks this record stands for (1 unless sampled).
    pub(crate) weight: f64,
    pub(crate) thread: u32,
    /// Call-stack id (0: none).
    pub(crate) stack: u32,
    pub(crate) align_log2: u8,
    pub(crate) sampled: bool,
    /// Whether its free is timed for the lifetime totals (records with stacks: reading the
    /// clock on every free would cost basic records a third of their time).
    pub(crate) timed: bool,
    /// The record's site, as an index into its shard's totals (set by the table).
    pub(crate) site: u32,
}

impl Rec {
    /// The bytes this record stands for (its size, weighted when sampled).
    #[inline(always)]
    fn bytes(&self) -> f64 {
        // Through i64: one conversion instruction instead of u64's several.
        let size = self.size as i64 as f64;
        if self.sampled {
            self.weight * size
        } else {
            size
        }
    }
}

/// Totals for one call site (allocator and stack), in weighted blocks and bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(crate) struct SiteStats {
    pub(crate) total_bytes: f64,
    pub(crate) total_blocks: f64,
    pub(crate) live_bytes: f64,
    pub(crate) live_blocks: f64,
    pub(crate) max_bytes: f64,
    pub(crate) max_blocks: f64,
    /// Summed lifetimes of the freed blocks, in ticks (weighted); only records with stacks
    /// time their frees.
    pub(crate) freed_lifetime_ticks: f64,
}

impl SiteStats {
    #[inline(always)]
    fn allocated(&mut self, rec: &Rec) {
        let bytes = rec.bytes();
        self.total_bytes += bytes;
        self.total_blocks += rec.weight;
        self.live_bytes += bytes;
        self.live_blocks += rec.weight;
        if self.live_bytes >= self.max_bytes {
            self.max_bytes = self.live_bytes;
            self.max_blocks = self.live_blocks;
        }
    }

    #[inline(always)]
    fn freed(&mut self, rec: &Rec, now: impl FnOnce() -> u64) {
        self.live_bytes -= rec.bytes();
        self.live_blocks -= rec.weight;
        if rec.timed {
            self.freed_lifetime_ticks += rec.weight * now().saturating_sub(rec.time) as i64 as f64;
        }
    }

    /// A record that left a thread's buffer for the table: its allocation was counted in
    /// the buffer's totals, its live bytes now count here.
    #[inline(always)]
    fn published(&mut self, rec: &Rec) {
        self.live_bytes += rec.bytes();
        self.live_blocks += rec.weight;
        self.peak();
    }

    /// A record taken from a thread's buffer by a realloc, put back here at its new size
    /// (the buffer no longer counts it live; the growth counts as allocated).
    fn moved_in(&mut self, rec: &Rec, old_size: usize) {
        let delta = rec.weight * (rec.size as i64 as f64 - old_size as i64 as f64);
        if delta > 0.0 {
            self.total_bytes += delta;
        }
        self.live_bytes += rec.bytes();
        self.live_blocks += rec.weight;
        self.peak();
    }

    #[inline(always)]
    fn peak(&mut self) {
        if self.live_bytes >= self.max_bytes {
            self.max_bytes = self.live_bytes;
            self.max_blocks = self.live_blocks;
        }
    }

    fn resized(&mut self, rec: &Rec, old_size: usize) {
        let delta = rec.weight * (rec.size as i64 as f64 - old_size as i64 as f64);
        if delta > 0.0 {
            self.total_bytes += delta;
        }
        self.live_bytes += delta;
        if self.live_bytes >= self.max_bytes {
            self.max_bytes = self.live_bytes;
            self.max_blocks = self.live_blocks;
        }
    }

    /// Adds another shard's totals (maxima add up to an upper bound of the true maximum).
    pub(crate) fn merge(&mut self, other: &SiteStats) {
        self.total_bytes += other.total_bytes;
        self.total_blocks += other.total_blocks;
        self.live_bytes += other.live_bytes;
        self.live_blocks += other.live_blocks;
        self.max_bytes += other.max_bytes;
        self.max_blocks += other.max_blocks;
        self.freed_lifetime_ticks += other.freed_lifetime_ticks;
    }
}

/// The site of a record: allocator index and stack id in one word.
#[inline]
pub(crate) fn site_key(alloc: u32, stack: u32) -> u64 {
    (u64::from(alloc) << 32) | u64::from(stack)
}

/// Multiply-fold mixing (the 128-bit product's halves xored): fast, and good in both
/// the high bits (hashbrown's tags) and the low bits (its bucket index).
#[inline(always)]
fn fold(x: u64, k: u64) -> u64 {
    let p = u128::from(x) * u128::from(k);
    (p as u64) ^ ((p >> 64) as u64)
}

/// The tables' hasher: [`fold`] over the written words.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct FoldHasher(u64);

impl Hasher for FoldHasher {
    #[inline]
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for chunk in bytes.chunks(8) {
            let mut word = [0u8; 8];
            word[..chunk.len()].copy_from_slice(chunk);
            self.write_u64(u64::from_le_bytes(word));
        }
    }
    #[inline]
    fn write_u64(&mut self, x: u64) {
        self.0 = fold(self.0 ^ x, 0x9E37_79B9_7F4A_7C15);
    }
    #[inline]
    fn write_u32(&mut self, x: u32) {
        self.write_u64(u64::from(x));
    }
    #[inline]
    fn write_usize(&mut self, x: usize) {
        self.write_u64(x as u64);
    }
}

/// Builds [`FoldHasher`]s.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct BuildFold;

impl BuildHasher for BuildFold {
    type Hasher = FoldHasher;
    #[inline]
    fn build_hasher(&self) -> FoldHasher {
        FoldHasher(0x243F_6A88_85A3_08D3)
    }
}

pub(crate) struct Shard {
    records: AddrMap<Rec, Internal>,
    /// Per-site totals of the records this shard saw, by site key.
    sites: IVec<(u64, SiteStats), Internal>,
    /// Positions in `sites`, by the hash of the site key.
    site_index: HashTable<u32, Internal>,
    /// The last site looked up (most programs record one site far more than others).
    last_site: (u64, u32),
}

impl Shard {
    const fn new() -> Self {
        Self {
            records: AddrMap::new(Internal),
            sites: IVec::new_in(Internal),
            site_index: HashTable::new_in(Internal),
            last_site: (u64::MAX, 0),
        }
    }

    /// The position of `key`'s totals in `sites`, added if new; `None` when out of memory.
    #[inline]
    fn site(&mut self, key: u64) -> Option<u32> {
        if self.last_site.0 == key {
            return Some(self.last_site.1);
        }
        let h = hash_word(key);
        let sites = &self.sites;
        let found = self
            .site_index
            .find(h, |&i| sites[i as usize].0 == key)
            .copied();
        let index = match found {
            Some(i) => i,
            None => self.add_site(key, h)?,
        };
        self.last_site = (key, index);
        Some(index)
    }

    #[cold]
    fn add_site(&mut self, key: u64, h: u64) -> Option<u32> {
        if self.sites.try_reserve(1).is_err() {
            return None;
        }
        let sites = &self.sites;
        if self
            .site_index
            .try_reserve(1, |&i| hash_word(sites[i as usize].0))
            .is_err()
        {
            return None;
        }
        let index = self.sites.len() as u32;
        self.sites.push((key, SiteStats::default()));
        let sites = &self.sites;
        self.site_index
            .insert_unique(h, index, |&i| hash_word(sites[i as usize].0));
        Some(index)
    }
}

#[repr(align(128))]
struct Padded(SpinLock<Shard>);

static TABLE: [Padded; SHARDS] = [const { Padded(SpinLock::new(Shard::new())) }; SHARDS];

/// Records dropped because the records' heap was out of memory.
static DROPPED: AtomicU64 = AtomicU64::new(0);

/// Counters of sampled records by address, one per 16-byte granule of a 1 MiB window, kept
/// 16 bytes apart (the counter of `addr` is at `addr & 0xF_FFF0`: one `and` on the free fast
/// path instead of a shift and a mask). 255 sticks (never decremented again). A page of it
/// is written only where a sampled record lives: 1 MiB of address space, little memory.
static FILTER: [AtomicU8; 1 << 20] = [const { AtomicU8::new(0) }; 1 << 20];

#[inline(always)]
fn hash_word(x: u64) -> u64 {
    fold(x, 0x9E37_79B9_7F4A_7C15)
}

/// The hash of a key: its bits 32..38 pick the shard, the map uses the low bits.
#[inline(always)]
fn hash_key(key: &Key) -> u64 {
    hash_parts(key.addr, key.alloc)
}

#[inline(always)]
fn shard_for(hash: u64) -> &'static SpinLock<Shard> {
    &TABLE[(hash >> 32) as usize % SHARDS].0
}

/// The counter of `addr`: its 16-byte granule within a 1 MiB window. No hash: the free
/// fast path asks this of every small block while sampling, and live sampled blocks (about
/// one per 512 KiB allocated) spread over the window anyway.
#[inline(always)]
fn filter_slot(addr: usize) -> &'static AtomicU8 {
    &FILTER[addr & (FILTER.len() - 16)]
}

/// Whether a sampled record may exist for a block at `addr` (false: certainly not).
#[inline(always)]
pub(crate) fn maybe_sampled(addr: usize) -> bool {
    filter_slot(addr).load(Relaxed) != 0
}

fn filter_add(addr: usize) {
    let _ = filter_slot(addr).fetch_update(Relaxed, Relaxed, |n| n.checked_add(1));
}

fn filter_remove(addr: usize) {
    let _ = filter_slot(addr).fetch_update(Relaxed, Relaxed, |n| (n != u8::MAX).then(|| n - 1));
}

/// Adds a record for a new block. Its key must not be in the table: a block's record is
/// removed before the block is freed, so a live key is never recorded twice.
#[inline]
pub(crate) fn insert(key: Key, mut rec: Rec) {
    let h = hash_key(&key);
    if rec.sampled {
        filter_add(key.addr);
    }
    let mut guard = shard_for(h).lock();
    let shard = &mut *guard;
    let Some(site) = shard.site(site_key(key.alloc, rec.stack)) else {
        drop(guard);
        return insert_failed(key.addr, rec.sampled);
    };
    rec.site = site;
    if !shard.records.insert(h, key.addr, key.alloc, rec) {
        drop(guard);
        return insert_failed(key.addr, rec.sampled);
    }
    shard.sites[site as usize].1.allocated(&rec);
}

#[cold]
fn insert_failed(addr: usize, sampled: bool) {
    if sampled {
        filter_remove(addr);
    }
    DROPPED.fetch_add(1, Relaxed);
}

/// Removes the record of a freed block, if there is one; `now` is the tick count. When
/// the table has none, it may be in another thread's buffer (`me` is the caller's own,
/// already searched): see [`buffer`].
#[inline]
pub(crate) fn remove(key: Key, now: impl FnOnce() -> u64, me: *const Buf) -> Option<Rec> {
    let h = hash_key(&key);
    let mut guard = shard_for(h).lock();
    let shard = &mut *guard;
    let Some(rec) = shard.records.remove(h, key.addr, key.alloc) else {
        // Still under the shard lock, so a buffered record cannot move into the table.
        return buffer::take_from_others(key, me);
    };
    shard.sites[rec.site as usize].1.freed(&rec, now);
    drop(guard);
    if rec.sampled {
        filter_remove(key.addr);
    }
    Some(rec)
}

/// Takes a record out for a realloc, without counting a free (see [`put_resized`]); the
/// flag tells whether it came from a thread's buffer.
pub(crate) fn take(key: Key, me: *const Buf) -> Option<(Rec, bool)> {
    let h = hash_key(&key);
    let mut guard = shard_for(h).lock();
    let Some(rec) = guard.records.remove(h, key.addr, key.alloc) else {
        return buffer::take_from_others(key, me).map(|rec| (rec, true));
    };
    drop(guard);
    if rec.sampled {
        filter_remove(key.addr);
    }
    Some((rec, false))
}

/// Puts back a record taken with [`take`] (or from the caller's buffer: `from_buffer`), at
/// its block's new key and size (`old_size` is the granted size it had), counting the
/// change in its site.
pub(crate) fn put_resized(key: Key, mut rec: Rec, old_size: usize, from_buffer: bool) {
    let h = hash_key(&key);
    if rec.sampled {
        filter_add(key.addr);
    }
    let mut guard = shard_for(h).lock();
    let shard = &mut *guard;
    let Some(site) = shard.site(site_key(key.alloc, rec.stack)) else {
        drop(guard);
        return insert_failed(key.addr, rec.sampled);
    };
    rec.site = site;
    if !shard.records.insert(h, key.addr, key.alloc, rec) {
        drop(guard);
        return insert_failed(key.addr, rec.sampled);
    }
    let stats = &mut shard.sites[site as usize].1;
    if from_buffer {
        stats.moved_in(&rec, old_size);
    } else {
        stats.resized(&rec, old_size);
    }
}

/// Moves a buffered record into the table: under its shard lock, `leave` takes it out of
/// the buffer, or refuses (`false`, nothing published). Returns what `leave` said. A
/// record the table has no room for is dropped and counted.
pub(crate) fn publish_with(key: Key, mut rec: Rec, leave: impl FnOnce() -> bool) -> bool {
    let h = hash_key(&key);
    let mut guard = shard_for(h).lock();
    if !leave() {
        return false;
    }
    let shard = &mut *guard;
    let Some(site) = shard.site(site_key(key.alloc, rec.stack)) else {
        drop(guard);
        insert_failed(key.addr, false);
        return true;
    };
    rec.site = site;
    if !shard.records.insert(h, key.addr, key.alloc, rec) {
        drop(guard);
        insert_failed(key.addr, false);
        return true;
    }
    shard.sites[site as usize].1.published(&rec);
    true
}

/// Adds a retired buffer's totals for one allocator to the table (its records were moved
/// in already). Maxima add up, an upper bound as across shards.
pub(crate) fn merge_retired(t: SiteTotals) {
    let key = site_key(t.alloc, 0);
    let mut guard = TABLE[(hash_word(key) >> 32) as usize % SHARDS].0.lock();
    let shard = &mut *guard;
    let Some(site) = shard.site(key) else {
        DROPPED.fetch_add(1, Relaxed);
        return;
    };
    shard.sites[site as usize].1.merge(&buffer_site(t, 0, 0));
}

/// A buffer's totals as site statistics, with its live records' bytes and blocks.
pub(crate) fn buffer_site(t: SiteTotals, live_bytes: u64, live_blocks: u64) -> SiteStats {
    SiteStats {
        total_bytes: t.total_bytes as f64,
        total_blocks: t.total_blocks as f64,
        live_bytes: live_bytes as f64,
        live_blocks: live_blocks as f64,
        max_bytes: t.max_bytes as f64,
        max_blocks: t.max_blocks as f64,
        freed_lifetime_ticks: 0.0,
    }
}

/// Holds every shard lock while `f` runs: readers that must see each record exactly
/// once while records move between the buffers and the table.
fn with_all_locked<R>(f: impl FnOnce(&mut [Option<SpinGuard<'static, Shard>>; SHARDS]) -> R) -> R {
    let mut guards: [Option<SpinGuard<'static, Shard>>; SHARDS] = [const { None }; SHARDS];
    for (g, padded) in guards.iter_mut().zip(&TABLE) {
        *g = Some(padded.0.lock());
    }
    f(&mut guards)
}

/// Records dropped so far for lack of memory.
pub(crate) fn dropped() -> u64 {
    DROPPED.load(Relaxed)
}

/// A copy of the table, made shard by shard into the records' own heap (no global
/// allocation under a lock).
pub(crate) struct Copy {
    pub(crate) records: IVec<(Key, Rec), Internal>,
    pub(crate) sites: HashMap<u64, SiteStats, BuildFold, Internal>,
    /// Set if the records' heap ran out of memory while copying.
    pub(crate) incomplete: bool,
}

/// Copies every record and site total, the buffered ones included.
pub(crate) fn copy() -> Copy {
    let mut out = Copy {
        records: IVec::new_in(Internal),
        sites: HashMap::with_hasher_in(BuildFold, Internal),
        incomplete: false,
    };
    with_all_locked(|shards| {
        for shard in shards.iter().flatten() {
            if out.records.try_reserve(shard.records.len()).is_err()
                || out.sites.try_reserve(shard.sites.len()).is_err()
            {
                out.incomplete = true;
                continue;
            }
            out.records.extend(shard.records.iter().map(|e| {
                let key = Key {
                    addr: e.addr,
                    alloc: e.alloc,
                };
                (key, e.value)
            }));
            for (k, s) in shard.sites.iter() {
                out.sites.entry(*k).or_default().merge(s);
            }
        }
        let mut v = CopyVisit {
            out: &mut out,
            mark: 0,
        };
        buffer::copy_all(&mut v);
    });
    out
}

/// [`copy`] of the threads' tables.
struct CopyVisit<'a> {
    out: &'a mut Copy,
    /// The records' length when the current thread's table was started.
    mark: usize,
}

impl buffer::Visit for CopyVisit<'_> {
    fn mark(&mut self) {
        self.mark = self.out.records.len();
    }
    fn rewind(&mut self) {
        self.out.records.truncate(self.mark);
    }
    fn record(&mut self, key: Key, rec: Rec) {
        if self.out.records.try_reserve(1).is_ok() {
            self.out.records.push((key, rec));
        } else {
            self.out.incomplete = true;
        }
    }
    fn site(&mut self, t: SiteTotals, live_bytes: u64, live_blocks: u64) {
        if self.out.sites.try_reserve(1).is_ok() {
            let s = buffer_site(t, live_bytes, live_blocks);
            self.out
                .sites
                .entry(site_key(t.alloc, 0))
                .or_default()
                .merge(&s);
        } else {
            self.out.incomplete = true;
        }
    }
}

/// Counts and sums the threads' records of one allocator (all with `alloc: None`).
#[derive(Default)]
struct Count {
    alloc: Option<u32>,
    totals: (usize, usize, usize),
    mark: (usize, usize, usize),
}

impl buffer::Visit for Count {
    fn mark(&mut self) {
        self.mark = self.totals;
    }
    fn rewind(&mut self) {
        self.totals = self.mark;
    }
    fn record(&mut self, key: Key, rec: Rec) {
        if self.alloc.is_none_or(|a| a == key.alloc) {
            self.totals.0 += 1;
            self.totals.1 += rec.size;
            self.totals.2 += rec.requested;
        }
    }
}

/// Counts the live records (for tests and summaries).
pub(crate) fn live_records() -> usize {
    with_all_locked(|shards| {
        let n: usize = shards.iter().flatten().map(|s| s.records.len()).sum();
        let mut count = Count::default();
        buffer::copy_all(&mut count);
        n + count.totals.0
    })
}

/// Records, granted bytes and requested bytes of one allocator, without allocating.
pub(crate) fn totals_of(alloc: u32) -> (usize, usize, usize) {
    with_all_locked(|shards| {
        let mut totals = (0, 0, 0);
        for shard in shards.iter().flatten() {
            for e in shard.records.iter() {
                if e.alloc == alloc {
                    totals.0 += 1;
                    totals.1 += e.value.size;
                    totals.2 += e.value.requested;
                }
            }
        }
        let mut count = Count {
            alloc: Some(alloc),
            ..Count::default()
        };
        buffer::copy_all(&mut count);
        (
            totals.0 + count.totals.0,
            totals.1 + count.totals.1,
            totals.2 + count.totals.2,
        )
    })
}

/// Takes every shard lock (before `fork`).
///
/// # Safety
/// Must be paired with [`unlock_all`] on the same thread, with no shard guard alive.
pub(crate) unsafe fn lock_all() {
    for padded in &TABLE {
        // SAFETY: forwarded; released by `unlock_all`.
        unsafe { padded.0.lock_raw() };
    }
}

/// Releases the locks taken by [`lock_all`] (after `fork`, in parent and child).
///
/// # Safety
/// Only after `lock_all`, with no shard guard alive.
pub(crate) unsafe fn unlock_all() {
    for padded in &TABLE {
        // SAFETY: forwarded from the caller.
        unsafe { padded.0.force_unlock() };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(size: usize, weight: f64, stack: u32, time: u64) -> Rec {
        Rec {
            size,
            requested: size,
            time,
            weight,
            thread: 1,
            stack,
            align_log2: 3,
            sampled: weight != 1.0,
            timed: true,
            site: 0,
        }
    }

    #[test]
    fn site_totals_follow_allocations_frees_and_resizes() {
        let mut s = SiteStats::default();
        let a = rec(100, 1.0, 1, 10);
        let b = rec(50, 1.0, 1, 20);
        s.allocated(&a);
        s.allocated(&b);
        s.freed(&a, || 110);
        let mut b2 = b;
        b2.size = 80;
        s.resized(&b2, 50);
        assert_eq!(s.total_bytes, 180.0);
        assert_eq!(s.total_blocks, 2.0);
        assert_eq!(s.live_bytes, 80.0);
        assert_eq!(s.live_blocks, 1.0);
        assert_eq!((s.max_bytes, s.max_blocks), (150.0, 2.0));
        assert_eq!(s.freed_lifetime_ticks, 100.0);
        let sampled = rec(10, 40.0, 1, 0);
        s.allocated(&sampled);
        assert_eq!(s.total_bytes, 580.0);
        assert_eq!(s.total_blocks, 42.0);
    }

    #[test]
    fn hashes_spread_aligned_addresses_over_shards_and_filter_slots() {
        let mut shards = [0usize; SHARDS];
        for i in 0..SHARDS * 64 {
            let key = Key {
                addr: 0x7f00_0000_0000 + i * 64,
                alloc: 1,
            };
            let s = shard_for(hash_key(&key)) as *const _ as usize;
            let index = TABLE
                .iter()
                .position(|p| &p.0 as *const _ as usize == s)
                .unwrap();
            shards[index] += 1;
        }
        assert!(shards.iter().all(|&n| n > 16), "{shards:?}");
        let slots: std::collections::HashSet<_> = (0..4096)
            .map(|i| filter_slot(0x5500_0000_0000 + i * 16) as *const _ as usize)
            .collect();
        assert!(slots.len() > 3500, "{}", slots.len());
    }

    #[test]
    fn the_filter_counts_and_saturates() {
        let addr = 0x1234_5670;
        let before = filter_slot(addr).load(Relaxed);
        filter_add(addr);
        assert!(maybe_sampled(addr));
        filter_remove(addr);
        assert_eq!(filter_slot(addr).load(Relaxed), before);
        let addr = 0x9999_0000_1230;
        for _ in 0..300 {
            filter_add(addr);
        }
        filter_remove(addr);
        assert_eq!(filter_slot(addr).load(Relaxed), u8::MAX);
    }

    #[test]
    fn insert_remove_take_and_put_keep_the_table_exact() {
        // Allocator index far above any real one, so other tests' records never collide.
        let alloc = 0xFFFF_0001;
        let k = |addr| Key { addr, alloc };
        insert(k(0x1000), rec(64, 1.0, 7, 5));
        insert(k(0x2000), rec(48, 1.0, 7, 6));
        let (moved, from_buffer) = take(k(0x1000), core::ptr::null()).unwrap();
        assert!(!from_buffer);
        let mut grown = moved;
        grown.size = 128;
        put_resized(k(0x3000), grown, moved.size, false);
        assert!(remove(k(0x1000), || 0, core::ptr::null()).is_none());
        let copy = copy();
        let mine: Vec<_> = copy
            .records
            .iter()
            .filter(|(key, _)| key.alloc == alloc)
            .map(|(key, r)| (key.addr, r.size))
            .collect();
        let mut mine = mine;
        mine.sort();
        assert_eq!(mine, [(0x2000, 48), (0x3000, 128)]);
        let site = copy.sites[&site_key(alloc, 7)];
        assert_eq!(site.live_bytes, 176.0);
        assert_eq!(site.live_blocks, 2.0);
        assert_eq!(site.total_blocks, 2.0);
        assert!(remove(k(0x2000), || 10, core::ptr::null()).is_some());
        assert!(remove(k(0x3000), || 10, core::ptr::null()).is_some());
        assert_eq!(
            copy_site(alloc, 7).map(|s| (s.live_bytes, s.live_blocks)),
            Some((0.0, 0.0))
        );
    }

    fn copy_site(alloc: u32, stack: u32) -> Option<SiteStats> {
        copy().sites.get(&site_key(alloc, stack)).copied()
    }
}
