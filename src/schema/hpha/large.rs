//! Large blocks: chunks of address-ordered blocks with a red-black tree of the free ones.
//!
//! Every block has a 16-byte header just before its payload: a pointer to the previous block
//! of its chunk and its payload size with flags in the low bits. The next block is found by
//! adding the size, so the blocks of a chunk form a list in address order without footers.
//! A chunk starts with a used block of size 0 and ends with a used "fence" of size 0, so
//! neighbour checks need no bounds tests.
//!
//! Free blocks sit in a [`FreeTree`] keyed by (size, address). Allocation takes the best fit,
//! splits off the front if the block must be aligned, and splits off the tail when the rest is
//! big enough to hold a free block. A free coalesces at once with both neighbours, so no two
//! free blocks are ever adjacent.
//!
//! Requests of [`DIRECT_THRESHOLD`] bytes or more, or aligned beyond [`MAX_TREE_ALIGN`], get a
//! mapping of their own ("direct" blocks), grown with `mremap` when reallocated. A freed
//! direct block's mapping is kept in a small cache ([`DirectCache`]) until the purge delay
//! passes, so a program that grows and frees big buffers again and again reuses pages it
//! has already touched instead of faulting fresh ones in each time.

use super::addr_map::{self, DIRECT as DIRECT_BLOCKS, Direct};
use super::purge::Cutoff;
use super::small::{SEGMENT_SIZE, Tag};
use super::tree::{FreeTree, NODE_SIZE, Node};
use crate::fatal::fatal;
use crate::os::PageSource;
use crate::sync::SpinLock;
use core::ptr::null_mut;
use core::sync::atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed};

/// Size of a block header.
const HDR: usize = 16;
const USED: usize = 1;
/// The payload, except its first `MIN_PAYLOAD` bytes (where a free block keeps its tree
/// node), reads as zero. Only meaningful on free blocks.
const CLEAN: usize = 2;
/// The block has a mapping of its own.
const DIRECT: usize = 4;
const FLAGS: usize = 15;
/// Where a used block keeps its tag (the owner id of [`Tag`]): the top bits of its size
/// word, which no size reaches (mappings stay below 2^47 bytes). Free blocks carry none.
const TAG_SHIFT: u32 = usize::BITS - Tag::BITS;
const TAG_BITS: usize = (Tag::MAX as usize) << TAG_SHIFT;
const SIZE_BITS: usize = !(FLAGS | TAG_BITS);

/// Smallest payload of a large block: room for a tree node.
pub(crate) const MIN_PAYLOAD: usize = NODE_SIZE;
/// Smallest remainder worth splitting off as a free block.
const MIN_SPLIT: usize = HDR + MIN_PAYLOAD;
/// Size of the chunks mapped for the tree.
pub const CHUNK_SIZE: usize = 4 * 1024 * 1024;
/// Payloads of at least this size get a mapping of their own.
pub const DIRECT_THRESHOLD: usize = 16 * 1024 * 1024;
/// A block reallocated to at least this size that cannot grow in place moves into a mapping
/// of its own (so that further growth is an `mremap`).
pub const GROW_DIRECT_MIN: usize = 1024 * 1024;
/// Alignments above this get a mapping of their own.
pub const MAX_TREE_ALIGN: usize = 64 * 1024;
/// Bytes of empty chunks kept mapped until the purge delay passes, to avoid map/unmap churn
/// (and the page faults of fresh memory) in programs that free and reallocate big batches;
/// a chunk that would exceed this is unmapped at once. The purge delay, not this bound, is
/// what normally returns them.
const RETAIN_EMPTY_BYTES: usize = 1024 * 1024 * 1024;
/// Free blocks at least this large have their pages returned by `garbage_collect`.
const PURGE_MIN: usize = 64 * 1024;
/// Candidates examined in size order before an aligned request falls back to a block that
/// surely fits.
const ALIGNED_SCAN: usize = 16;
/// Freed direct mappings kept for reuse, at most (see [`DirectCache`]).
const DIRECT_CACHE_SLOTS: usize = 8;
/// Bytes of freed direct mappings kept for reuse, at most.
const DIRECT_CACHE_BYTES: usize = 64 * 1024 * 1024;

/// A freed direct block's mapping, kept whole for the next direct block that fits it.
#[derive(Clone, Copy)]
struct CachedMapping {
    start: *mut u8,
    len: usize,
    /// The purge epoch it was freed in: [`LargeHeap::purge`] unmaps it once that is past.
    stamp: u64,
}

/// Mappings of freed direct blocks, kept (pages and all) until the purge delay passes or a
/// new direct block of about their size takes one. Without it, a buffer that grows past
/// [`GROW_DIRECT_MIN`] and is freed, again and again, faults every page in afresh each time
/// (the `realloc` workload of the comparison: about 110,000 page faults, where mimalloc,
/// which keeps freed segments, had about 4,000).
struct DirectCache {
    slots: [CachedMapping; DIRECT_CACHE_SLOTS],
    count: usize,
    bytes: usize,
}

// SAFETY: the pointers are mappings the cache owns; the lock around it serialises use.
unsafe impl Send for DirectCache {}

/// Mappings a cache operation let go, for the caller to unmap once the lock is released.
struct Evicted {
    list: [(*mut u8, usize); DIRECT_CACHE_SLOTS + 1],
    count: usize,
}

impl Evicted {
    const fn new() -> Self {
        Self {
            list: [(null_mut(), 0); DIRECT_CACHE_SLOTS + 1],
            count: 0,
        }
    }

    fn push(&mut self, start: *mut u8, len: usize) {
        self.list[self.count] = (start, len);
        self.count += 1;
    }

    /// Unmaps them all.
    ///
    /// # Safety
    /// Every mapping listed is owned by the caller and used by nobody.
    unsafe fn unmap(self, source: &impl PageSource) {
        for &(start, len) in &self.list[..self.count] {
            // SAFETY: forwarded from the caller.
            unsafe { source.unmap(start, len) };
        }
    }
}

impl DirectCache {
    const EMPTY: CachedMapping = CachedMapping {
        start: null_mut(),
        len: 0,
        stamp: 0,
    };

    const fn new() -> Self {
        Self {
            slots: [Self::EMPTY; DIRECT_CACHE_SLOTS],
            count: 0,
            bytes: 0,
        }
    }

    fn remove(&mut self, i: usize) -> CachedMapping {
        let m = self.slots[i];
        self.count -= 1;
        self.slots[i] = self.slots[self.count];
        self.slots[self.count] = Self::EMPTY;
        self.bytes -= m.len;
        m
    }

    /// The smallest kept mapping of at least `len` bytes and less than twice that (so a
    /// block never holds more than double what it asked for), taken out of the cache.
    fn take(&mut self, len: usize) -> Option<CachedMapping> {
        let best = (0..self.count)
            .filter(|&i| self.slots[i].len >= len && self.slots[i].len / 2 < len)
            .min_by_key(|&i| self.slots[i].len)?;
        Some(self.remove(best))
    }

    /// Keeps a freed mapping, letting the oldest go while the cache is over its slots or
    /// bytes; a mapping bigger than the whole budget is let go at once.
    fn put(&mut self, m: CachedMapping, evicted: &mut Evicted) {
        if m.len > DIRECT_CACHE_BYTES {
            evicted.push(m.start, m.len);
            return;
        }
        while self.count == DIRECT_CACHE_SLOTS || self.bytes + m.len > DIRECT_CACHE_BYTES {
            let oldest = (0..self.count)
                .min_by_key(|&i| self.slots[i].stamp)
                .expect("an over-full cache holds a mapping");
            let gone = self.remove(oldest);
            evicted.push(gone.start, gone.len);
        }
        self.slots[self.count] = m;
        self.count += 1;
        self.bytes += m.len;
    }

    /// Lets go of every mapping freed before `cut`.
    fn purge(&mut self, cut: Cutoff, evicted: &mut Evicted) {
        let mut i = 0;
        while i < self.count {
            if cut.covers(self.slots[i].stamp) {
                let gone = self.remove(i);
                evicted.push(gone.start, gone.len);
            } else {
                i += 1;
            }
        }
    }
}

#[repr(C)]
struct Block {
    prev: *mut Block,
    size_flags: usize,
}

#[repr(C)]
struct ChunkHeader {
    next: *mut ChunkHeader,
    prev: *mut ChunkHeader,
    len: usize,
    /// Purge epoch at which the chunk last became empty.
    idle_since: u64,
    /// The allocator (tag) that owns this chunk; 0 is the heap itself.
    tag: u32,
    _reserved: [u32; 3],
}
const _: () = assert!(core::mem::size_of::<ChunkHeader>() % 16 == 0);
const CHUNK_HDR: usize = core::mem::size_of::<ChunkHeader>();
/// Offset of the first real block header in a chunk (after the chunk header and the dummy).
const FIRST_BLOCK: usize = CHUNK_HDR + HDR;
/// Bytes of a chunk that are not payload of its first block.
const CHUNK_OVERHEAD: usize = FIRST_BLOCK + HDR + HDR;

/// Bytes a direct block's mapping holds before its payload (at least): its block header and
/// 16 bytes that once held the mapping's start and length. The registry of direct blocks
/// (`addr_map::DIRECT`) holds those now, out of the user's reach; the space stays so that
/// payloads keep their offset in the mapping.
const DIRECT_HDR: usize = 16 + HDR;

// Block accessors. Each requires a valid block header.
#[inline]
unsafe fn size(b: *mut Block) -> usize {
    // SAFETY: caller passes a valid header.
    unsafe { (*b).size_flags & SIZE_BITS }
}
/// The tag bits of a used block's size word, to carry over when its size changes.
#[inline]
unsafe fn tag_bits(b: *mut Block) -> usize {
    // SAFETY: caller passes a valid header.
    unsafe { (*b).size_flags & TAG_BITS }
}
#[inline]
unsafe fn flags(b: *mut Block) -> usize {
    // SAFETY: caller passes a valid header.
    unsafe { (*b).size_flags & FLAGS }
}
#[inline]
unsafe fn is_used(b: *mut Block) -> bool {
    // SAFETY: caller passes a valid header.
    unsafe { flags(b) & USED != 0 }
}
#[inline]
unsafe fn payload(b: *mut Block) -> *mut u8 {
    // SAFETY: the payload follows the header inside the same mapping.
    unsafe { b.cast::<u8>().add(HDR) }
}
#[inline]
unsafe fn next(b: *mut Block) -> *mut Block {
    // SAFETY: the next header follows the payload; the fence ends every chunk.
    unsafe { payload(b).add(size(b)).cast() }
}
#[inline]
fn block_of(ptr: *mut u8) -> *mut Block {
    ptr.wrapping_sub(HDR).cast()
}
#[inline]
unsafe fn node(b: *mut Block) -> *mut Node {
    // SAFETY: a free block's payload holds its node.
    unsafe { payload(b).cast() }
}
#[inline]
fn block_of_node(n: *mut Node) -> *mut Block {
    n.cast::<u8>().wrapping_sub(HDR).cast()
}
/// Whether a free block is the only block of its chunk.
#[inline]
unsafe fn spans_chunk(b: *mut Block) -> bool {
    // SAFETY: the dummy and the fence are valid headers of size 0 around every chunk.
    unsafe { size((*b).prev) == 0 && size(next(b)) == 0 }
}

/// A block handed out by the large heap.
pub(crate) struct LargeGrant {
    pub ptr: *mut u8,
    pub size: usize,
    /// How many leading bytes may be non-zero (the rest of the block reads as zero).
    pub dirty_prefix: usize,
}

struct LargeState {
    tree: FreeTree,
    chunks: *mut ChunkHeader,
    chunk_count: usize,
    chunk_bytes: usize,
    empty_chunks: usize,
    empty_bytes: usize,
    free_bytes: usize,
    live_blocks: usize,
    granted_bytes: usize,
    allocations: u64,
    frees: u64,
}

// SAFETY: pointers into chunks owned by the heap; the lock around the state serialises use.
unsafe impl Send for LargeState {}

/// Counters of the large side.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct LargeStats {
    pub granted_bytes: usize,
    pub live_blocks: usize,
    pub allocations: u64,
    pub frees: u64,
    pub chunks: usize,
    pub chunk_bytes: usize,
    pub free_blocks: usize,
    pub free_bytes: usize,
    pub largest_free: usize,
    pub direct_blocks: usize,
    pub direct_granted_bytes: usize,
    pub direct_mapped_bytes: usize,
    /// Mappings of freed direct blocks kept for reuse (see [`DirectCache`]).
    pub direct_cached_bytes: usize,
}

impl LargeState {
    const fn new() -> Self {
        Self {
            tree: FreeTree::new(),
            chunks: null_mut(),
            chunk_count: 0,
            chunk_bytes: 0,
            empty_chunks: 0,
            empty_bytes: 0,
            free_bytes: 0,
            live_blocks: 0,
            granted_bytes: 0,
            allocations: 0,
            frees: 0,
        }
    }

    /// Adds a free block to the tree; a large dirty one is stamped with the purge epoch
    /// `stamp` just after its node, so a later purge pass knows how long it has been idle.
    unsafe fn insert_free(&mut self, b: *mut Block, stamp: u64) {
        // SAFETY: `b` is a free block with room for a node (size >= MIN_PAYLOAD), and for the
        // stamp when it is at least PURGE_MIN bytes.
        unsafe {
            self.free_bytes += size(b);
            self.tree.insert(node(b), size(b));
            if size(b) >= PURGE_MIN && flags(b) & CLEAN == 0 {
                payload(b).add(MIN_PAYLOAD).cast::<u64>().write(stamp);
            }
        }
    }

    /// Records that the chunk spanned by the free block `b` is empty.
    unsafe fn note_empty_chunk(&mut self, b: *mut Block, stamp: u64) {
        // SAFETY: `b` spans its chunk, so the chunk header sits before the dummy.
        unsafe {
            let chunk = chunk_of(b);
            (*chunk).idle_since = stamp;
            self.empty_chunks += 1;
            self.empty_bytes += (*chunk).len;
        }
    }

    /// Records that the empty chunk spanned by `b` is empty no longer (or is going away).
    unsafe fn note_chunk_not_empty(&mut self, b: *mut Block) {
        // SAFETY: as above.
        unsafe {
            self.empty_chunks -= 1;
            self.empty_bytes -= (*chunk_of(b)).len;
        }
    }

    unsafe fn remove_free(&mut self, b: *mut Block) {
        // SAFETY: `b` is a free block in the tree.
        unsafe {
            self.free_bytes -= size(b);
            self.tree.remove(node(b));
        }
    }

    /// The gap before the aligned payload if `b` can hold `payload` bytes at `align`.
    unsafe fn fit_gap(b: *mut Block, payload: usize, align: usize) -> Option<usize> {
        // SAFETY: `b` is a valid free block.
        let (start, avail) = unsafe { (payload_addr(b), size(b)) };
        let mut gap = start.next_multiple_of(align) - start;
        if gap != 0 && gap < MIN_SPLIT {
            gap = (start + MIN_SPLIT).next_multiple_of(align) - start;
        }
        (gap.checked_add(payload)? <= avail).then_some(gap)
    }

    /// A free block that can hold `payload` at `align`, or null.
    fn find_fit(&self, payload: usize, align: usize) -> *mut Block {
        let mut n = self.tree.lower_bound(payload);
        if align <= HDR || n.is_null() {
            return if n.is_null() {
                null_mut()
            } else {
                block_of_node(n)
            };
        }
        // SAFETY: nodes returned by the tree are in it, inside free blocks.
        unsafe {
            for _ in 0..ALIGNED_SCAN {
                if n.is_null() {
                    break;
                }
                if Self::fit_gap(block_of_node(n), payload, align).is_some() {
                    return block_of_node(n);
                }
                n = FreeTree::successor(n);
            }
            let Some(surely) = payload
                .checked_add(align)
                .and_then(|s| s.checked_add(MIN_SPLIT))
            else {
                return null_mut();
            };
            let n = self.tree.lower_bound(surely);
            if n.is_null() {
                null_mut()
            } else {
                block_of_node(n)
            }
        }
    }

    /// Maps a chunk big enough for `payload` at `align` and adds its block to the tree.
    fn grow(&mut self, payload: usize, align: usize, source: &impl PageSource) -> bool {
        let granule = source.granularity();
        let Some(need) = payload
            .checked_add(align)
            .and_then(|n| n.checked_add(MIN_SPLIT + CHUNK_OVERHEAD))
            .and_then(|n| n.checked_next_multiple_of(granule))
        else {
            return false;
        };
        // Whole 2 MiB regions at a 2 MiB boundary, as small-block segments are: a large block
        // wrongly freed with a small layout then has its would-be page header (read within
        // the first 64 KiB of its 2 MiB region) inside this mapping, so the check reports the
        // misuse instead of faulting. Untouched address space costs no memory.
        let Some(len) = need.max(CHUNK_SIZE).checked_next_multiple_of(SEGMENT_SIZE) else {
            return false;
        };
        let base = source.map(len, SEGMENT_SIZE.max(granule), 0);
        if base.is_null() {
            return false;
        }
        // Huge pages where the source's policy wants them: hash tables and other large
        // blocks read at random gain as much from them as small blocks do.
        // SAFETY: a fresh mapping nothing has written to, reachable only from here.
        unsafe { source.hint_huge_pages(base, len, self.chunk_bytes) };
        addr_map::note_chunk(base, len);
        // SAFETY: `base` is a fresh zeroed mapping of `len` bytes; all headers written lie
        // inside it.
        unsafe {
            let chunk: *mut ChunkHeader = base.cast();
            (*chunk).len = len;
            (*chunk).next = self.chunks;
            if !self.chunks.is_null() {
                (*self.chunks).prev = chunk;
            }
            self.chunks = chunk;
            let dummy: *mut Block = base.add(CHUNK_HDR).cast();
            (*dummy).size_flags = USED;
            let first: *mut Block = base.add(FIRST_BLOCK).cast();
            (*first).prev = dummy;
            (*first).size_flags = (len - CHUNK_OVERHEAD) | CLEAN;
            let fence = next(first);
            (*fence).prev = first;
            (*fence).size_flags = USED;
            self.chunk_count += 1;
            self.chunk_bytes += len;
            self.note_empty_chunk(first, 0);
            self.insert_free(first, 0);
        }
        true
    }

    /// Carves `payload` bytes at `align` out of the free block `b`.
    unsafe fn take(
        &mut self,
        mut b: *mut Block,
        want: usize,
        align: usize,
        tag: Tag,
        stamp: u64,
    ) -> LargeGrant {
        // SAFETY: `b` is a free block in the tree that fits (checked by `find_fit`); every
        // header written lies inside `b`.
        unsafe {
            self.remove_free(b);
            if spans_chunk(b) {
                self.note_chunk_not_empty(b);
            }
            let gap = Self::fit_gap(b, want, align).unwrap_or(0);
            let clean = flags(b) & CLEAN != 0;
            if gap > 0 {
                let total = size(b);
                (*b).size_flags = (gap - HDR) | flags(b);
                let aligned: *mut Block = payload(b).add(gap - HDR).cast();
                (*aligned).prev = b;
                (*aligned).size_flags = total - gap;
                (*next(aligned)).prev = aligned;
                self.insert_free(b, stamp);
                b = aligned;
            }
            let rest = size(b) - want;
            if rest >= MIN_SPLIT {
                let tail: *mut Block = payload(b).add(want).cast();
                (*tail).prev = b;
                (*tail).size_flags = (rest - HDR) | if clean { CLEAN } else { 0 };
                (*next(tail)).prev = tail;
                (*b).size_flags = want;
                self.insert_free(tail, stamp);
            }
            (*b).size_flags = size(b) | USED | ((tag as usize) << TAG_SHIFT);
            self.live_blocks += 1;
            self.granted_bytes += size(b);
            self.allocations += 1;
            let dirty_prefix = match (clean, gap > 0) {
                (false, _) => size(b),
                (true, false) => MIN_PAYLOAD,
                (true, true) => 0,
            };
            LargeGrant {
                ptr: payload(b),
                size: size(b),
                dirty_prefix,
            }
        }
    }

    /// Cuts the used block `b` down to `keep` bytes, freeing the tail if it is big enough.
    unsafe fn trim(&mut self, b: *mut Block, keep: usize, stamp: u64) {
        // SAFETY: `b` is a used block with size >= keep; headers written lie inside it.
        unsafe {
            let rest = size(b) - keep;
            if rest < MIN_SPLIT {
                return;
            }
            let tail: *mut Block = payload(b).add(keep).cast();
            (*tail).prev = b;
            (*tail).size_flags = rest - HDR;
            (*next(tail)).prev = tail;
            (*b).size_flags = keep | USED | tag_bits(b);
            self.granted_bytes -= rest;
            let after = next(tail);
            if !is_used(after) {
                self.remove_free(after);
                (*tail).size_flags = size(tail) + HDR + size(after);
                (*next(tail)).prev = tail;
            }
            self.insert_free(tail, stamp);
        }
    }

    /// Unlinks the chunk whose only block is the free block `b` and returns its mapping.
    unsafe fn unlink_chunk(&mut self, b: *mut Block) -> (*mut u8, usize) {
        // SAFETY: `b` spans its chunk, so the chunk header sits before the dummy.
        unsafe {
            let chunk = chunk_of(b);
            let (prev, next) = ((*chunk).prev, (*chunk).next);
            if prev.is_null() {
                self.chunks = next;
            } else {
                (*prev).next = next;
            }
            if !next.is_null() {
                (*next).prev = prev;
            }
            self.chunk_count -= 1;
            self.chunk_bytes -= (*chunk).len;
            // Before the caller unmaps it: from now on a free into it is named as such.
            addr_map::note_chunk_gone(chunk.cast(), (*chunk).len);
            (chunk.cast(), (*chunk).len)
        }
    }
}

/// Where a pointer handed to the large heap lies, as the heap's own maps say.
enum Where {
    /// In a live chunk, whose header is here.
    Chunk(*mut ChunkHeader),
    /// A live block with a mapping of its own (when it was looked up).
    Direct,
}

/// Judges `ptr` from the address map and the registry of direct blocks, before anything
/// near it is read; aborts with a diagnosis when it is in no memory the large heap holds.
#[inline]
fn locate(ptr: *mut u8) -> Where {
    match addr_map::kind_of(block_of(ptr).addr()) {
        addr_map::CHUNK_START | addr_map::CHUNK_CONT => {
            let start = addr_map::chunk_start(block_of(ptr).addr());
            Where::Chunk(ptr.with_addr(start).cast())
        }
        addr_map::SMALL => report_bad_large_free(ptr),
        _ => match DIRECT_BLOCKS.lookup(ptr) {
            Direct::Live { .. } => Where::Direct,
            _ => report_bad_large_free(ptr),
        },
    }
}

/// Whether `b` is a used block of `chunk` whose links agree with its neighbours: the
/// header of a block freed by its owner. Reads only headers inside the chunk.
///
/// # Safety
/// `chunk` is a live chunk holding `b`; its lock is held.
unsafe fn is_live_block(b: *mut Block, chunk: *mut ChunkHeader) -> bool {
    // SAFETY: every header read is checked to lie inside the chunk first.
    unsafe {
        let base = chunk.addr();
        let end = base + (*chunk).len;
        if b.addr() < base + FIRST_BLOCK || b.addr() + 2 * HDR > end || b.addr() % HDR != 0 {
            return false;
        }
        let f = flags(b);
        if f & USED == 0 || f & DIRECT != 0 {
            return false;
        }
        let n = payload(b).addr().checked_add(size(b));
        if n.is_none_or(|n| n + HDR > end) {
            return false;
        }
        let p = (*b).prev;
        if p.addr() < base + CHUNK_HDR || p.addr() >= b.addr() || p.addr() % HDR != 0 {
            return false;
        }
        (*next(b)).prev == b && next(p) == b
    }
}

/// What a free into a chunk that is not a live block's start hit.
enum Hit {
    /// The start of a free block: a double free.
    FreeStart,
    /// Inside free space at this block's payload (a double free of a block merged with a
    /// neighbour, or a pointer into freed memory).
    InFree(usize),
    /// Inside the used block with this payload and size.
    InUsed(usize, usize),
    /// The chunk's block list is damaged (a write past a block's end?) before `ptr`.
    Damaged(usize),
}

/// Walks `chunk`'s blocks in address order to find what `ptr` points into.
///
/// # Safety
/// `chunk` is a live chunk holding `ptr`; its lock is held.
unsafe fn diagnose(ptr: *mut u8, chunk: *mut ChunkHeader) -> Hit {
    // SAFETY: every header read is checked to lie inside the chunk first.
    unsafe {
        let base = chunk.addr();
        let end = base + (*chunk).len;
        let mut b: *mut Block = chunk.cast::<u8>().add(CHUNK_HDR).cast();
        loop {
            let start = payload(b).addr();
            let Some(stop) = start.checked_add(size(b)).filter(|&s| s + HDR <= end) else {
                return Hit::Damaged(b.addr());
            };
            if ptr.addr() >= b.addr() && ptr.addr() < stop.max(start + 1) {
                return match (is_used(b), ptr.addr() == start) {
                    (false, true) => Hit::FreeStart,
                    (false, false) => Hit::InFree(start),
                    (true, _) => Hit::InUsed(start, size(b)),
                };
            }
            if size(b) == 0 && b.addr() != base + CHUNK_HDR {
                return Hit::Damaged(b.addr());
            }
            b = next(b);
        }
    }
}

/// Aborts with the diagnosis of a free into a chunk that is not a live block's start.
#[cold]
#[inline(never)]
fn report_in_chunk(ptr: *mut u8, hit: Hit) -> ! {
    let p = ptr.addr();
    match hit {
        Hit::FreeStart => fatal!(
            "double free of {:#x} (a large block that is already free)",
            p
        ),
        Hit::InFree(at) => fatal!(
            "double free of {:#x}: it lies in free space of the large-block heap (the free \
             block at {:#x}; freed before, and merged with a neighbour)",
            p,
            at
        ),
        Hit::InUsed(at, size) if at == p => fatal!(
            "heap corruption: the header of the large block {:#x} ({} bytes) is damaged (a \
             write past the end of the block before it?)",
            p,
            size
        ),
        Hit::InUsed(at, size) => fatal!(
            "free of {:#x}, which is inside the large block at {:#x} ({} bytes), not at its \
             start",
            p,
            at,
            size
        ),
        Hit::Damaged(at) => fatal!(
            "heap corruption: free of {:#x}, but the large-block heap's block list is damaged \
             at {:#x} (a write past the end of a block?)",
            p,
            at
        ),
    }
}

/// Aborts with the diagnosis of a large free of `ptr` that lies in no live chunk and is no
/// live direct block, from the address map and the registry (nothing at `ptr` is read).
#[cold]
#[inline(never)]
pub(crate) fn report_bad_large_free(ptr: *mut u8) -> ! {
    let p = ptr.addr();
    if DIRECT_BLOCKS.lookup(ptr) == Direct::Freed {
        fatal!(
            "double free of {:#x} (a block with its own mapping, already freed)",
            p
        );
    }
    match addr_map::kind_of(block_of(ptr).addr()) {
        addr_map::SMALL => fatal!(
            "wrong layout: free of {:#x} with a layout past the small classes, but it is a \
             small block (the layout passed to dealloc differs from the one allocated)",
            p
        ),
        addr_map::RETIRED_CHUNK | addr_map::RETIRED_SMALL => fatal!(
            "double free of {:#x}: the memory it lay in was already returned to the OS (freed \
             before, and its chunk released)",
            p
        ),
        _ => fatal!(
            "not a block of this heap: free of {:#x} as a large block, but tagalloc never \
             mapped that address (a stack address, memory of another allocator, or a pointer \
             inside a block with its own mapping)",
            p
        ),
    }
}

/// The chunk of a free block that spans it (the chunk header sits before the dummy).
#[inline]
unsafe fn chunk_of(b: *mut Block) -> *mut ChunkHeader {
    // SAFETY: the caller passes a block whose `prev` is its chunk's dummy.
    unsafe { (*b).prev.cast::<u8>().sub(CHUNK_HDR).cast() }
}

#[inline]
unsafe fn payload_addr(b: *mut Block) -> usize {
    // SAFETY: forwarded.
    unsafe { payload(b) }.addr()
}

/// The large-block heap: the chunk tree under one lock, plus counters of direct blocks.
pub(crate) struct LargeHeap {
    state: SpinLock<LargeState>,
    direct_blocks: AtomicUsize,
    direct_granted: AtomicUsize,
    direct_mapped: AtomicUsize,
    direct_allocations: AtomicU64,
    direct_frees: AtomicU64,
    direct_cache: SpinLock<DirectCache>,
}

impl LargeHeap {
    pub(crate) const fn new() -> Self {
        Self {
            state: SpinLock::new(LargeState::new()),
            direct_cache: SpinLock::new(DirectCache::new()),
            direct_blocks: AtomicUsize::new(0),
            direct_granted: AtomicUsize::new(0),
            direct_mapped: AtomicUsize::new(0),
            direct_allocations: AtomicU64::new(0),
            direct_frees: AtomicU64::new(0),
        }
    }

    /// The payload size used for a request of `size` bytes (None on overflow).
    #[inline]
    fn payload_for(size: usize) -> Option<usize> {
        size.max(MIN_PAYLOAD).checked_next_multiple_of(HDR)
    }

    /// Allocates a large block carrying `tag` (see [`tag_of`](Self::tag_of)); `None` when
    /// out of memory or the request cannot be met.
    pub(crate) fn allocate(
        &self,
        size: usize,
        align: usize,
        tag: Tag,
        source: &impl PageSource,
        stamp: u64,
    ) -> Option<LargeGrant> {
        let payload = Self::payload_for(size)?;
        if payload >= DIRECT_THRESHOLD || align > MAX_TREE_ALIGN {
            return self.allocate_direct(payload, align, tag, source);
        }
        let mut st = self.state.lock();
        let mut b = st.find_fit(payload, align);
        if b.is_null() {
            if !st.grow(payload, align, source) {
                return None;
            }
            b = st.find_fit(payload, align);
            debug_assert!(!b.is_null());
        }
        // SAFETY: `b` is a free block in the tree that fits the request.
        Some(unsafe { st.take(b, payload, align, tag, stamp) })
    }

    fn direct_layout(payload: usize, align: usize, granule: usize) -> Option<(usize, usize)> {
        let header_space = if align <= granule {
            DIRECT_HDR.max(align)
        } else {
            granule
        };
        let len = header_space
            .checked_add(payload)?
            .checked_next_multiple_of(granule)?;
        Some((header_space, len))
    }

    fn allocate_direct(
        &self,
        payload: usize,
        align: usize,
        tag: Tag,
        source: &impl PageSource,
    ) -> Option<LargeGrant> {
        let granule = source.granularity();
        let (header_space, len) = Self::direct_layout(payload, align, granule)?;
        if align <= granule {
            let kept = self.direct_cache.lock().take(len);
            if let Some(m) = kept {
                // SAFETY: a mapping of `m.len >= len` bytes the cache owned, now ours whole.
                let grant = unsafe { self.format_direct(m.start, m.len, header_space, tag) };
                return match grant {
                    // Its pages hold whatever the block before wrote.
                    Some(grant) => Some(LargeGrant {
                        dirty_prefix: grant.size,
                        ..grant
                    }),
                    None => {
                        // SAFETY: nothing refers to the mapping.
                        unsafe { source.unmap(m.start, m.len) };
                        None
                    }
                };
            }
        }
        let (base, len) = if align <= granule {
            match source.huge_page_size() {
                // A block big enough to grow into huge pages (a buffer past
                // `GROW_DIRECT_MIN`): its mapping's first page (the headers and the payload's
                // first bytes) ends on a huge-page boundary, so that the rest is whole huge
                // pages, and it takes the first of them whole: growing into it then costs
                // one fault, not one per 4 KiB page (see `PageSource::remap` for the rest).
                Some(huge) if payload >= GROW_DIRECT_MIN && huge > granule => {
                    let len = len.max(granule + huge);
                    (source.map(len, huge, granule), len)
                }
                _ => (source.map(len, granule, 0), len),
            }
        } else {
            (source.map(len, align, header_space), len)
        };
        if base.is_null() {
            return None;
        }
        // SAFETY: a fresh mapping nothing has written to, reachable only from here. One block
        // filling its own mapping: no lightly used heap to spare.
        unsafe { source.hint_huge_pages(base, len, usize::MAX) };
        // SAFETY: `base` is a fresh mapping of `len` bytes; the headers lie before the payload
        // inside it.
        let grant = unsafe { self.format_direct(base, len, header_space, tag) };
        if grant.is_none() {
            // SAFETY: the mapping was just made and nothing else refers to it.
            unsafe { source.unmap(base, len) };
        }
        grant
    }

    /// Writes a direct block's headers into its mapping and records it in the registry of
    /// direct blocks; `None` (nothing counted) when the registry cannot grow.
    unsafe fn format_direct(
        &self,
        base: *mut u8,
        len: usize,
        header_space: usize,
        tag: Tag,
    ) -> Option<LargeGrant> {
        // SAFETY: the caller passes a mapping of `len` bytes with room for the headers.
        unsafe {
            let ptr = base.add(header_space);
            if !DIRECT_BLOCKS.insert(ptr, base, len) {
                return None;
            }
            let capacity = len - header_space;
            let b = block_of(ptr);
            (*b).prev = null_mut();
            (*b).size_flags = capacity | USED | DIRECT | ((tag as usize) << TAG_SHIFT);
            self.direct_blocks.fetch_add(1, Relaxed);
            self.direct_granted.fetch_add(capacity, Relaxed);
            self.direct_mapped.fetch_add(len, Relaxed);
            self.direct_allocations.fetch_add(1, Relaxed);
            Some(LargeGrant {
                ptr,
                size: capacity,
                dirty_prefix: 0,
            })
        }
    }

    /// The tag of a live large block, as [`allocate`](Self::allocate) was given it. A
    /// resize keeps it, in place or moved.
    ///
    /// # Safety
    /// `ptr` must be a live block of a large heap.
    #[inline]
    pub(crate) unsafe fn tag_of(ptr: *mut u8) -> Tag {
        locate(ptr);
        // SAFETY: a live block has a valid header before it (and `locate` found `ptr` in
        // memory the heap holds, so the header is mapped whatever the caller passed).
        unsafe { ((*block_of(ptr)).size_flags >> TAG_SHIFT) as Tag }
    }

    /// The usable size of a live large block.
    ///
    /// # Safety
    /// `ptr` must be a live block of this heap.
    #[inline]
    pub(crate) unsafe fn usable_size(ptr: *mut u8) -> usize {
        locate(ptr);
        // SAFETY: a live block has a valid header before it (mapped: see `tag_of`).
        unsafe { size(block_of(ptr)) }
    }

    /// Frees a large block. Free space is stamped with the purge epoch `stamp`; a chunk that
    /// becomes empty is kept for reuse if `retain_empty` (within a byte budget), else unmapped.
    ///
    /// # Safety
    /// `ptr` must be a live block returned by this heap.
    pub(crate) unsafe fn free(
        &self,
        ptr: *mut u8,
        source: &impl PageSource,
        stamp: u64,
        retain_empty: bool,
    ) {
        let mut b = block_of(ptr);
        let chunk = match locate(ptr) {
            Where::Chunk(chunk) => chunk,
            Where::Direct => match DIRECT_BLOCKS.take(ptr) {
                // SAFETY: the registry says `ptr` is a live direct block mapped there.
                Direct::Live { map_start, map_len } => unsafe {
                    return self.free_direct(b, map_start, map_len, source, stamp, retain_empty);
                },
                // Freed by another thread since `locate` looked.
                _ => report_bad_large_free(ptr),
            },
        };
        // SAFETY: `chunk` is a live chunk holding `ptr` (the address map says so), so every
        // header checked lies in mapped memory; the block is taken apart only once
        // `is_live_block` confirmed it is a used block of the chunk with consistent links.
        unsafe {
            let mut st = self.state.lock();
            if !is_live_block(b, chunk) {
                let what = diagnose(ptr, chunk);
                drop(st);
                report_in_chunk(ptr, what);
            }
            st.live_blocks -= 1;
            st.granted_bytes -= size(b);
            st.frees += 1;
            (*b).size_flags = size(b);
            let n = next(b);
            if !is_used(n) {
                st.remove_free(n);
                (*b).size_flags = size(b) + HDR + size(n);
                (*next(b)).prev = b;
            }
            let p = (*b).prev;
            if !is_used(p) {
                st.remove_free(p);
                (*p).size_flags = size(p) + HDR + size(b);
                (*next(p)).prev = p;
                b = p;
            }
            if spans_chunk(b) {
                let len = (*chunk_of(b)).len;
                if !retain_empty || st.empty_bytes + len > RETAIN_EMPTY_BYTES {
                    let (base, len) = st.unlink_chunk(b);
                    drop(st);
                    source.unmap(base, len);
                    return;
                }
                st.note_empty_chunk(b, stamp);
            }
            st.insert_free(b, stamp);
        }
    }

    /// Frees a direct block whose mapping the registry gave (never the lengths in its
    /// headers, which a user could have overwritten): its mapping goes to the cache of
    /// freed mappings if `retain` (see [`DirectCache`]), else back to the OS.
    ///
    /// # Safety
    /// `b` is the header of a direct block the registry just marked freed, mapped at
    /// `[start, start + len)`.
    unsafe fn free_direct(
        &self,
        b: *mut Block,
        start: *mut u8,
        len: usize,
        source: &impl PageSource,
        stamp: u64,
        retain: bool,
    ) {
        // SAFETY: forwarded from the caller; the header is inside the mapping.
        let capacity = len - (unsafe { payload(b) }.addr() - start.addr());
        self.direct_blocks.fetch_sub(1, Relaxed);
        self.direct_granted.fetch_sub(capacity, Relaxed);
        self.direct_mapped.fetch_sub(len, Relaxed);
        self.direct_frees.fetch_add(1, Relaxed);
        let mut evicted = Evicted::new();
        if retain {
            let kept = CachedMapping { start, len, stamp };
            self.direct_cache.lock().put(kept, &mut evicted);
        } else {
            evicted.push(start, len);
        }
        // SAFETY: the freed mapping (if not kept) and the ones the cache let go are ours.
        unsafe { evicted.unmap(source) };
    }

    /// Resizes a large block without moving it if possible (or with `mremap` for a direct
    /// block). Returns the new pointer and size, or `None` if the caller must move it.
    ///
    /// # Safety
    /// `ptr` must be a live block of this heap allocated with `align`.
    pub(crate) unsafe fn resize(
        &self,
        ptr: *mut u8,
        new_size: usize,
        align: usize,
        source: &impl PageSource,
        stamp: u64,
    ) -> Option<(*mut u8, usize)> {
        let new_payload = Self::payload_for(new_size)?;
        let b = block_of(ptr);
        let direct = matches!(locate(ptr), Where::Direct);
        // SAFETY: `ptr` is live, so its header is valid; the lock guards tree blocks.
        unsafe {
            if direct {
                return self.resize_direct(b, new_payload, align, source);
            }
            let mut st = self.state.lock();
            let old = size(b);
            if new_payload <= old {
                st.trim(b, new_payload, stamp);
                return Some((ptr, size(b)));
            }
            let n = next(b);
            if new_payload < DIRECT_THRESHOLD && !is_used(n) && old + HDR + size(n) >= new_payload {
                st.remove_free(n);
                let merged = old + HDR + size(n);
                (*b).size_flags = merged | USED | tag_bits(b);
                (*next(b)).prev = b;
                st.granted_bytes += merged - old;
                st.trim(b, new_payload, stamp);
                return Some((ptr, size(b)));
            }
            drop(st);
            // A block that keeps growing moves into a mapping of its own, which later grows
            // with `mremap`: the kernel moves page tables instead of us copying bytes.
            if new_payload >= GROW_DIRECT_MIN && align <= source.granularity() {
                let grant = self.allocate_direct(new_payload, align, Self::tag_of(ptr), source)?;
                core::ptr::copy_nonoverlapping(ptr, grant.ptr, old);
                self.free(ptr, source, stamp, true);
                return Some((grant.ptr, grant.size));
            }
            None
        }
    }

    /// Forgets the direct block at `ptr` (`capacity` bytes in a mapping of `map_len`) that
    /// a resize moved to a new mapping: the old address is gone from the registry (a free of
    /// it now is a double free), and the move counts as neither a free nor, once the new
    /// mapping is formatted, one more allocation.
    fn forget_moved(&self, ptr: *mut u8, capacity: usize, map_len: usize) {
        DIRECT_BLOCKS.take(ptr);
        self.direct_blocks.fetch_sub(1, Relaxed);
        self.direct_granted.fetch_sub(capacity, Relaxed);
        self.direct_mapped.fetch_sub(map_len, Relaxed);
        self.direct_allocations.fetch_sub(1, Relaxed);
    }

    unsafe fn resize_direct(
        &self,
        b: *mut Block,
        new_payload: usize,
        align: usize,
        source: &impl PageSource,
    ) -> Option<(*mut u8, usize)> {
        // SAFETY: `b` is a live direct block; its headers describe its mapping.
        unsafe {
            let capacity = size(b);
            if new_payload <= capacity && new_payload > capacity / 2 {
                return Some((payload(b), capacity));
            }
            let granule = source.granularity();
            if align > granule {
                return None;
            }
            // The mapping as the registry has it, not as the headers (user-writable) say.
            let Direct::Live {
                map_start: start,
                map_len: old_len,
            } = DIRECT_BLOCKS.lookup(payload(b))
            else {
                report_bad_large_free(payload(b));
            };
            let header_space = payload(b).addr() - start.addr();
            let tag = Self::tag_of(payload(b));
            let new_len = header_space
                .checked_add(new_payload)?
                .checked_next_multiple_of(granule)?;
            if new_len > old_len {
                // Growing: a kept mapping of the new size takes the contents if there is one
                // (a copy into pages already touched). The old mapping goes back to the OS:
                // kept, it raised the `realloc` workload's peak by 17% (104.6 -> 122.3 MB)
                // for no fewer page faults, since buffers growing in step rarely reuse one.
                // The kept mapping is ours whole: the cache gave it up.
                let kept = self.direct_cache.lock().take(new_len);
                if let Some(m) = kept {
                    let Some(grant) = self.format_direct(m.start, m.len, header_space, tag) else {
                        source.unmap(m.start, m.len);
                        return None;
                    };
                    core::ptr::copy_nonoverlapping(payload(b), grant.ptr, capacity);
                    self.forget_moved(payload(b), capacity, old_len);
                    source.unmap(start, old_len);
                    return Some((grant.ptr, grant.size));
                }
            }
            let base = source.remap(start, old_len, new_len);
            if base.is_null() {
                return None;
            }
            self.forget_moved(payload(b), capacity, old_len);
            match self.format_direct(base, new_len, header_space, tag) {
                Some(grant) => Some((grant.ptr, grant.size)),
                None => fatal!(
                    "out of memory for the registry of blocks with their own mapping, while \
                     resizing {:#x}",
                    base.addr() + header_space
                ),
            }
        }
    }

    /// Unmaps empty chunks and purges the pages of large free blocks that have been idle
    /// since before `cut`.
    pub(crate) fn purge(&self, cut: Cutoff, source: &impl PageSource) {
        let mut evicted = Evicted::new();
        self.direct_cache.lock().purge(cut, &mut evicted);
        // SAFETY: mappings the cache let go: nobody else refers to them.
        unsafe { evicted.unmap(source) };
        let granule = source.granularity();
        let mut st = self.state.lock();
        // SAFETY: chunks in the list are live mappings; blocks reached are valid; a chunk is
        // unmapped only after its block left the tree and the chunk left the list.
        unsafe {
            let mut chunk = st.chunks;
            while !chunk.is_null() {
                let next_chunk = (*chunk).next;
                let first: *mut Block = chunk.cast::<u8>().add(FIRST_BLOCK).cast();
                if !is_used(first) && spans_chunk(first) && cut.covers((*chunk).idle_since) {
                    st.remove_free(first);
                    st.note_chunk_not_empty(first);
                    let (base, len) = st.unlink_chunk(first);
                    source.unmap(base, len);
                }
                chunk = next_chunk;
            }
            let mut n = st.tree.first();
            while !n.is_null() {
                let b = block_of_node(n);
                if size(b) >= PURGE_MIN
                    && flags(b) & CLEAN == 0
                    && cut.covers(payload(b).add(MIN_PAYLOAD).cast::<u64>().read())
                {
                    let start = payload(b).add(MIN_PAYLOAD);
                    let end = payload(b).add(size(b));
                    let inner_start = start.map_addr(|a| a.next_multiple_of(granule));
                    let inner_end = end.map_addr(|a| a & !(granule - 1));
                    if inner_end > inner_start {
                        let len = inner_end.addr() - inner_start.addr();
                        if source.purge(inner_start, len) {
                            start.write_bytes(0, inner_start.addr() - start.addr());
                            inner_end.write_bytes(0, end.addr() - inner_end.addr());
                            (*b).size_flags |= CLEAN;
                        }
                    }
                }
                n = FreeTree::successor(n);
            }
        }
    }

    /// Takes the large heap's lock (before `fork()`).
    ///
    /// # Safety
    /// Must be paired with [`LargeHeap::unlock_all`], with no guard alive in between.
    pub(crate) unsafe fn lock_all(&self) {
        // SAFETY: forwarded from the caller.
        unsafe { self.state.lock_raw() };
    }

    /// Releases the lock taken by [`LargeHeap::lock_all`].
    ///
    /// # Safety
    /// Only after `lock_all`, with no guard alive.
    pub(crate) unsafe fn unlock_all(&self) {
        // SAFETY: forwarded from the caller.
        unsafe { self.state.force_unlock() };
    }

    pub(crate) fn stats(&self) -> LargeStats {
        let st = self.state.lock();
        LargeStats {
            granted_bytes: st.granted_bytes + self.direct_granted.load(Relaxed),
            live_blocks: st.live_blocks + self.direct_blocks.load(Relaxed),
            allocations: st.allocations + self.direct_allocations.load(Relaxed),
            frees: st.frees + self.direct_frees.load(Relaxed),
            chunks: st.chunk_count,
            chunk_bytes: st.chunk_bytes,
            free_blocks: st.tree.len(),
            free_bytes: st.free_bytes,
            largest_free: st.tree.largest(),
            direct_blocks: self.direct_blocks.load(Relaxed),
            direct_granted_bytes: self.direct_granted.load(Relaxed),
            direct_mapped_bytes: self.direct_mapped.load(Relaxed),
            direct_cached_bytes: self.direct_cache.lock().bytes,
        }
    }

    /// Unmaps every chunk (the heap is being dropped). Direct blocks still live are the
    /// owner's leak and stay mapped.
    pub(crate) fn release_all(&mut self, source: &impl PageSource) {
        let mut evicted = Evicted::new();
        self.direct_cache.get_mut().purge(Cutoff::ALL, &mut evicted);
        // SAFETY: mappings the cache let go: nobody else refers to them.
        unsafe { evicted.unmap(source) };
        let st = self.state.get_mut();
        // SAFETY: every chunk in the list is a live mapping of `len` bytes.
        unsafe {
            let mut chunk = st.chunks;
            while !chunk.is_null() {
                let next = (*chunk).next;
                addr_map::note_chunk_gone(chunk.cast(), (*chunk).len);
                source.unmap(chunk.cast(), (*chunk).len);
                chunk = next;
            }
        }
        *st = LargeState::new();
    }

    /// Checks the block lists of every chunk against the tree (for tests).
    pub(crate) fn validate(&self) -> Result<(), &'static str> {
        let st = self.state.lock();
        let tree_nodes = st.tree.validate()?;
        let mut free_seen = 0;
        let mut free_bytes = 0;
        let mut used_bytes = 0;
        let mut used_blocks = 0;
        let mut empty = 0;
        // SAFETY: chunks and their blocks are valid while the lock is held.
        unsafe {
            let mut chunk = st.chunks;
            while !chunk.is_null() {
                if chunk.addr() % SEGMENT_SIZE != 0 || (*chunk).len % SEGMENT_SIZE != 0 {
                    return Err("a chunk is not whole 2 MiB regions at a 2 MiB boundary");
                }
                let mut b: *mut Block = chunk.cast::<u8>().add(FIRST_BLOCK).cast();
                let mut prev: *mut Block = chunk.cast::<u8>().add(CHUNK_HDR).cast();
                let mut prev_free = false;
                let mut total = 0;
                while size(b) != 0 {
                    if (*b).prev != prev {
                        return Err("block prev link is wrong");
                    }
                    if payload(b).addr() % HDR != 0 || size(b) < MIN_PAYLOAD {
                        return Err("block misaligned or too small");
                    }
                    let free = !is_used(b);
                    if free && prev_free {
                        return Err("two adjacent free blocks");
                    }
                    if free {
                        free_seen += 1;
                        free_bytes += size(b);
                        if spans_chunk(b) {
                            empty += 1;
                        }
                        if FreeTree::size_of(node(b)) != size(b) {
                            return Err("tree key differs from block size");
                        }
                    } else {
                        used_blocks += 1;
                        used_bytes += size(b);
                    }
                    total += HDR + size(b);
                    prev_free = free;
                    prev = b;
                    b = next(b);
                }
                if (*b).prev != prev {
                    return Err("fence prev link is wrong");
                }
                if total + FIRST_BLOCK + HDR != (*chunk).len {
                    return Err("blocks do not fill their chunk");
                }
                chunk = (*chunk).next;
            }
        }
        if free_seen != tree_nodes {
            return Err("free blocks and tree nodes differ");
        }
        if free_bytes != st.free_bytes {
            return Err("free byte counter is wrong");
        }
        if used_bytes != st.granted_bytes || used_blocks != st.live_blocks {
            return Err("live counters differ from the chunks");
        }
        if empty != st.empty_chunks {
            return Err("empty chunk count is wrong");
        }
        if st.empty_chunks == 0 && st.empty_bytes != 0 {
            return Err("empty chunk bytes are wrong");
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: usize = 1024 * 1024;

    /// A mapping at a made-up address (the cache never touches its memory).
    fn mapping(at: usize, len: usize, stamp: u64) -> CachedMapping {
        CachedMapping {
            start: core::ptr::without_provenance_mut(at),
            len,
            stamp,
        }
    }

    fn evicted_lens(e: &Evicted) -> Vec<usize> {
        e.list[..e.count].iter().map(|&(_, len)| len).collect()
    }

    #[test]
    fn the_cache_gives_the_smallest_fit_under_twice_the_request() {
        let mut cache = DirectCache::new();
        let mut evicted = Evicted::new();
        for (i, len) in [8 * MIB, 2 * MIB, 3 * MIB].into_iter().enumerate() {
            cache.put(mapping((i + 1) << 30, len, i as u64), &mut evicted);
        }
        assert_eq!(evicted.count, 0);
        assert_eq!(cache.bytes, 13 * MIB);
        // 3 MiB: 3 MiB fits best (8 MiB is more than twice).
        assert_eq!(cache.take(3 * MIB).map(|m| m.len), Some(3 * MIB));
        // 1.5 MiB: 2 MiB.
        assert_eq!(cache.take(3 * MIB / 2).map(|m| m.len), Some(2 * MIB));
        // 1 MiB: nothing under 2 MiB left.
        assert!(cache.take(MIB).is_none());
        assert_eq!(cache.take(5 * MIB).map(|m| m.len), Some(8 * MIB));
        assert_eq!((cache.count, cache.bytes), (0, 0));
    }

    #[test]
    fn the_cache_lets_the_oldest_go_past_its_slots_or_bytes_and_purges_by_age() {
        let mut cache = DirectCache::new();
        let mut evicted = Evicted::new();
        for i in 0..DIRECT_CACHE_SLOTS {
            cache.put(mapping((i + 1) << 30, MIB + i, i as u64), &mut evicted);
        }
        assert_eq!(evicted.count, 0);
        // One more slot than there are: the oldest (stamp 0) goes.
        cache.put(mapping(100 << 30, MIB, 50), &mut evicted);
        assert_eq!(evicted_lens(&evicted), [MIB]);
        // Past the bytes: as many of the oldest as it takes.
        let mut evicted = Evicted::new();
        cache.put(
            mapping(101 << 30, DIRECT_CACHE_BYTES - 5 * MIB, 60),
            &mut evicted,
        );
        assert_eq!(evicted_lens(&evicted), [MIB + 1, MIB + 2, MIB + 3, MIB + 4]);
        assert!(cache.bytes <= DIRECT_CACHE_BYTES);
        // Bigger than the whole budget: let go at once.
        let mut evicted = Evicted::new();
        cache.put(mapping(102 << 30, DIRECT_CACHE_BYTES + 1, 70), &mut evicted);
        assert_eq!(evicted_lens(&evicted), [DIRECT_CACHE_BYTES + 1]);
        // Purge: everything freed before stamp 55.
        let mut evicted = Evicted::new();
        cache.purge(Cutoff { before: 55 }, &mut evicted);
        assert_eq!(evicted_lens(&evicted).len(), 4, "stamps 5, 6, 7 and 50");
        assert_eq!(cache.count, 1);
        assert_eq!(cache.bytes, DIRECT_CACHE_BYTES - 5 * MIB);
    }
}
