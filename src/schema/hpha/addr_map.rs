//! What the heaps mapped, by address: a map of 2 MiB granules and a registry of the blocks
//! with a mapping of their own, so that a pointer handed to `free` is judged from tagalloc's
//! own bookkeeping before anything at or near it is read.
//!
//! Small-block segments and large-block chunks are 2 MiB-aligned whole multiples of 2 MiB,
//! so every 2 MiB granule of the address space is either entirely one of them or neither.
//! [`kind_of`] says which, with two loads: a static table of 4096 leaf pointers (one per
//! 32 GiB of address space) and a leaf of one byte per granule, mapped on first use and
//! never released (16 KiB each). A granule that was mapped and later returned to the OS
//! stays marked as such (`RETIRED_*`), so a free into memory already unmapped is told apart
//! from a pointer tagalloc never handed out.
//!
//! Blocks with a mapping of their own ("direct" blocks) are not granule-aligned; they are
//! kept in [`DirectRegistry`], an open-addressing table keyed by the block's address under
//! a lock, which holds the mapping's start and length: the free path unmaps what the table
//! says, never what the block's header (user-writable memory) says. A freed direct block
//! stays in the table as freed until the table is rebuilt, so a second free is named a
//! double free.
//!
//! Nothing here allocates: leaves and tables come straight from the OS (not counted in the
//! [`OsAllocator`](crate::os::OsAllocator)'s figures: they are bookkeeping, like a page
//! table).

use super::small::SEGMENT_SIZE;
use crate::sync::SpinLock;
use core::ptr::null_mut;
use core::sync::atomic::{AtomicPtr, AtomicU8, Ordering::*};

/// A granule tagalloc never mapped (or whose mapping this map was not told about).
pub(crate) const NONE: u8 = 0;
/// A granule of a live small-block segment.
pub(crate) const SMALL: u8 = 1;
/// The first granule of a live large-block chunk.
pub(crate) const CHUNK_START: u8 = 2;
/// A later granule of a live large-block chunk.
pub(crate) const CHUNK_CONT: u8 = 3;
/// A granule of a small-block segment since returned to the OS.
pub(crate) const RETIRED_SMALL: u8 = 4;
/// A granule of a large-block chunk since returned to the OS.
pub(crate) const RETIRED_CHUNK: u8 = 5;

const GRANULE_SHIFT: u32 = SEGMENT_SIZE.trailing_zeros();
/// Address bits the map covers (user space of x86-64 and AArch64 Linux with 4-level pages).
const ADDRESS_BITS: u32 = 47;
/// Granules per leaf: a leaf covers 32 GiB.
const LEAF_SHIFT: u32 = 14;
const LEAF_LEN: usize = 1 << LEAF_SHIFT;
const LEAVES: usize = 1 << (ADDRESS_BITS - GRANULE_SHIFT - LEAF_SHIFT);

static ROOT: [AtomicPtr<AtomicU8>; LEAVES] = [const { AtomicPtr::new(null_mut()) }; LEAVES];

/// Maps `len` bytes of zeroed memory for bookkeeping (not counted by the `OsAllocator`);
/// null when the OS refuses.
fn map_table(len: usize) -> *mut u8 {
    // SAFETY: an anonymous private mapping with no address hint has no preconditions.
    let p = unsafe {
        libc::mmap(
            null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        null_mut()
    } else {
        p.cast()
    }
}

/// The (leaf, index) of the granule holding `addr`; `None` past the covered address bits.
#[inline(always)]
fn split(addr: usize) -> Option<(usize, usize)> {
    let granule = addr >> GRANULE_SHIFT;
    let leaf = granule >> LEAF_SHIFT;
    (leaf < LEAVES).then_some((leaf, granule & (LEAF_LEN - 1)))
}

/// What the granule holding `addr` is (one of the constants above). Never reads memory
/// outside the map itself.
#[inline]
pub(crate) fn kind_of(addr: usize) -> u8 {
    let Some((leaf, index)) = split(addr) else {
        return NONE;
    };
    let leaf = ROOT[leaf].load(Acquire);
    if leaf.is_null() {
        return NONE;
    }
    // SAFETY: a published leaf is a live mapping of `LEAF_LEN` entries, never released.
    unsafe { (*leaf.add(index)).load(Acquire) }
}

/// The leaf holding `addr`'s granule, mapped on first use; `None` past the covered
/// addresses or when the OS refuses a leaf (then the granule stays unmarked, so its blocks
/// are reported as foreign if freed wrongly, and correct frees of them are still accepted
/// by the paths that do not ask the map).
fn leaf_for(leaf: usize) -> Option<*mut AtomicU8> {
    let slot = &ROOT[leaf];
    let now = slot.load(Acquire);
    if !now.is_null() {
        return Some(now);
    }
    let fresh = map_table(LEAF_LEN).cast::<AtomicU8>();
    if fresh.is_null() {
        return None;
    }
    match slot.compare_exchange(null_mut(), fresh, AcqRel, Acquire) {
        Ok(_) => Some(fresh),
        Err(theirs) => {
            // SAFETY: our fresh leaf was never published.
            unsafe { libc::munmap(fresh.cast(), LEAF_LEN) };
            Some(theirs)
        }
    }
}

/// Marks the granules of `[base, base + len)` (2 MiB-aligned, a multiple of 2 MiB) as
/// `first` for the first and `rest` for the others.
fn mark(base: usize, len: usize, first: u8, rest: u8) {
    debug_assert!(base % SEGMENT_SIZE == 0 && len % SEGMENT_SIZE == 0);
    for i in 0..len / SEGMENT_SIZE {
        let addr = base + i * SEGMENT_SIZE;
        let Some((leaf, index)) = split(addr) else {
            return;
        };
        let Some(leaf) = leaf_for(leaf) else {
            return;
        };
        let kind = if i == 0 { first } else { rest };
        // SAFETY: a leaf from `leaf_for` is a live mapping of `LEAF_LEN` entries.
        unsafe { (*leaf.add(index)).store(kind, Release) };
    }
}

/// Records a fresh small-block segment (before any block of it is handed out).
pub(crate) fn note_segment(base: *mut u8) {
    mark(base.addr(), SEGMENT_SIZE, SMALL, SMALL);
}

/// Records that a small-block segment goes back to the OS (before it is unmapped).
pub(crate) fn note_segment_gone(base: *mut u8) {
    mark(base.addr(), SEGMENT_SIZE, RETIRED_SMALL, RETIRED_SMALL);
}

/// Records a fresh large-block chunk of `len` bytes.
pub(crate) fn note_chunk(base: *mut u8, len: usize) {
    mark(base.addr(), len, CHUNK_START, CHUNK_CONT);
}

/// Records that a large-block chunk goes back to the OS (before it is unmapped).
pub(crate) fn note_chunk_gone(base: *mut u8, len: usize) {
    mark(base.addr(), len, RETIRED_CHUNK, RETIRED_CHUNK);
}

/// The start of the live chunk whose granule holds `addr` (which [`kind_of`] says is a
/// chunk's): back over the chunk's later granules to its first.
pub(crate) fn chunk_start(addr: usize) -> usize {
    let mut g = addr & !(SEGMENT_SIZE - 1);
    while kind_of(g) == CHUNK_CONT {
        g -= SEGMENT_SIZE;
    }
    g
}

/// A direct block's entry: its payload address (0: empty slot), and its mapping.
#[derive(Clone, Copy)]
struct Entry {
    ptr: usize,
    map_start: usize,
    /// The mapping's length, with [`FREED`] set once the block was freed.
    map_len: usize,
}

/// Set in [`Entry::map_len`] (a page multiple, so its low bit is free) of a freed block.
const FREED: usize = 1;
const FIRST_CAPACITY: usize = 256;

/// The open-addressing table of direct blocks (see the module docs), guarded by a lock.
struct Table {
    entries: *mut Entry,
    capacity: usize,
    /// Entries in use, live or freed.
    used: usize,
}

// SAFETY: the table's memory is owned by the registry and used only under its lock.
unsafe impl Send for Table {}

/// What the registry knows of a pointer handed to a large free.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Direct {
    /// A live direct block: its mapping.
    Live { map_start: *mut u8, map_len: usize },
    /// A direct block already freed.
    Freed,
    /// Not a direct block.
    Unknown,
}

/// Blocks with a mapping of their own, by address.
pub(crate) struct DirectRegistry(SpinLock<Table>);

/// The registry of every heap in the process (addresses are unique process-wide).
pub(crate) static DIRECT: DirectRegistry = DirectRegistry(SpinLock::new(Table {
    entries: null_mut(),
    capacity: 0,
    used: 0,
}));

#[inline]
fn hash(ptr: usize, capacity: usize) -> usize {
    // Direct payloads are page-aligned plus a fixed header space: mix the page number.
    ((ptr >> 12).wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 20) & (capacity - 1)
}

impl Table {
    /// The slot of `ptr`, or the empty slot where it would go.
    ///
    /// # Safety
    /// `entries` is a live table of `capacity` (a power of two) with an empty slot.
    unsafe fn find(&self, ptr: usize) -> *mut Entry {
        let mut i = hash(ptr, self.capacity);
        loop {
            // SAFETY: `i < capacity`; the table has an empty slot, so the probe ends.
            let e = unsafe { self.entries.add(i) };
            // SAFETY: as above.
            let key = unsafe { (*e).ptr };
            if key == ptr || key == 0 {
                return e;
            }
            i = (i + 1) & (self.capacity - 1);
        }
    }

    /// Makes room for one more entry: a table at least twice the live entries, freed ones
    /// dropped. `false` when the OS refuses the memory.
    fn reserve_one(&mut self) -> bool {
        if (self.used + 1) * 2 <= self.capacity {
            return true;
        }
        let mut live = 0usize;
        for i in 0..self.capacity {
            // SAFETY: `i < capacity` of a live table.
            let e = unsafe { *self.entries.add(i) };
            if e.ptr != 0 && e.map_len & FREED == 0 {
                live += 1;
            }
        }
        let capacity = ((live + 1) * 4).next_power_of_two().max(FIRST_CAPACITY);
        let bytes = capacity * core::mem::size_of::<Entry>();
        let entries = map_table(bytes).cast::<Entry>();
        if entries.is_null() {
            return false;
        }
        let old = core::mem::replace(
            self,
            Table {
                entries,
                capacity,
                used: 0,
            },
        );
        for i in 0..old.capacity {
            // SAFETY: `i < capacity` of the old, still mapped table.
            let e = unsafe { *old.entries.add(i) };
            if e.ptr != 0 && e.map_len & FREED == 0 {
                // SAFETY: the new table has room for every live entry and an empty slot.
                unsafe { *self.find(e.ptr) = e };
                self.used += 1;
            }
        }
        if !old.entries.is_null() {
            // SAFETY: the old table was mapped by `map_table` with this size and is no
            // longer reachable.
            unsafe {
                libc::munmap(
                    old.entries.cast(),
                    old.capacity * core::mem::size_of::<Entry>(),
                )
            };
        }
        true
    }
}

impl DirectRegistry {
    /// Takes the registry's lock and keeps it, before `fork()` (the innermost lock: nothing
    /// else is taken while it is held).
    ///
    /// # Safety
    /// Must be paired with [`unlock_after_fork`](Self::unlock_after_fork) on the same thread
    /// (or in the child it forks).
    pub(crate) unsafe fn lock_for_fork(&self) {
        // SAFETY: forwarded from the caller; released by `unlock_after_fork`.
        unsafe { self.0.lock_raw() };
    }

    /// Releases the lock [`lock_for_fork`](Self::lock_for_fork) took.
    ///
    /// # Safety
    /// Only after `lock_for_fork`, with no guard of the lock alive.
    pub(crate) unsafe fn unlock_after_fork(&self) {
        // SAFETY: forwarded from the caller.
        unsafe { self.0.force_unlock() };
    }

    /// Records a live direct block at `ptr` mapped at `[map_start, map_start + map_len)`.
    /// `false` when the registry cannot grow (the caller then gives the mapping back).
    pub(crate) fn insert(&self, ptr: *mut u8, map_start: *mut u8, map_len: usize) -> bool {
        let mut t = self.0.lock();
        if !t.reserve_one() {
            return false;
        }
        // SAFETY: `reserve_one` left a live table with an empty slot.
        unsafe {
            let e = t.find(ptr.addr());
            if (*e).ptr == 0 {
                t.used += 1;
            }
            *e = Entry {
                ptr: ptr.addr(),
                map_start: map_start.addr(),
                map_len,
            };
        }
        true
    }

    /// What the registry knows of `ptr`.
    pub(crate) fn lookup(&self, ptr: *mut u8) -> Direct {
        let t = self.0.lock();
        if t.capacity == 0 {
            return Direct::Unknown;
        }
        // SAFETY: a live table with an empty slot (at most half full).
        let e = unsafe { *t.find(ptr.addr()) };
        if e.ptr == 0 {
            Direct::Unknown
        } else if e.map_len & FREED != 0 {
            Direct::Freed
        } else {
            Direct::Live {
                map_start: ptr.with_addr(e.map_start),
                map_len: e.map_len,
            }
        }
    }

    /// Marks the live direct block `ptr` freed and returns its mapping; what the registry
    /// knows of it otherwise (nothing is changed then).
    pub(crate) fn take(&self, ptr: *mut u8) -> Direct {
        let t = self.0.lock();
        if t.capacity == 0 {
            return Direct::Unknown;
        }
        // SAFETY: a live table with an empty slot.
        unsafe {
            let e = t.find(ptr.addr());
            if (*e).ptr == 0 {
                return Direct::Unknown;
            }
            if (*e).map_len & FREED != 0 {
                return Direct::Freed;
            }
            let live = Direct::Live {
                map_start: ptr.with_addr((*e).map_start),
                map_len: (*e).map_len,
            };
            (*e).map_len |= FREED;
            live
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn granules_are_marked_and_retired() {
        // Far below where mmap places mappings, so no heap of this test binary is there.
        let base = 0x1000_0000_0000usize;
        let p = core::ptr::without_provenance_mut::<u8>(base);
        assert_eq!(kind_of(base), NONE);
        note_chunk(p, 3 * SEGMENT_SIZE);
        assert_eq!(kind_of(base + 5), CHUNK_START);
        assert_eq!(kind_of(base + 2 * SEGMENT_SIZE + 100), CHUNK_CONT);
        assert_eq!(chunk_start(base + 2 * SEGMENT_SIZE + 100), base);
        assert_eq!(kind_of(base + 3 * SEGMENT_SIZE), NONE);
        note_chunk_gone(p, 3 * SEGMENT_SIZE);
        assert_eq!(kind_of(base + SEGMENT_SIZE), RETIRED_CHUNK);
        // Past the covered address bits: never anything.
        assert_eq!(kind_of(usize::MAX - 5), NONE);
    }

    #[test]
    fn direct_blocks_are_found_freed_and_forgotten_on_growth() {
        let r = DirectRegistry(SpinLock::new(Table {
            entries: null_mut(),
            capacity: 0,
            used: 0,
        }));
        let at = |a: usize| core::ptr::without_provenance_mut::<u8>(a);
        assert_eq!(r.lookup(at(0x10_0000)), Direct::Unknown);
        for i in 1..=1000usize {
            assert!(r.insert(at(i << 24 | 64), at(i << 24), 1 << 24));
        }
        assert_eq!(
            r.take(at(7 << 24 | 64)),
            Direct::Live {
                map_start: at(7 << 24),
                map_len: 1 << 24
            }
        );
        assert_eq!(r.take(at(7 << 24 | 64)), Direct::Freed);
        assert_eq!(r.lookup(at(7 << 24 | 64)), Direct::Freed);
        assert_eq!(r.lookup(at(8 << 24)), Direct::Unknown);
        for i in 1..=1000usize {
            if i != 7 && i != 500 {
                assert!(matches!(r.take(at(i << 24 | 64)), Direct::Live { .. }));
            }
        }
        // Growing drops freed entries and keeps live ones.
        for i in 2000..4000usize {
            assert!(r.insert(at(i << 24 | 64), at(i << 24), 1 << 24));
        }
        assert_eq!(r.lookup(at(7 << 24 | 64)), Direct::Unknown);
        assert!(matches!(r.lookup(at(500 << 24 | 64)), Direct::Live { .. }));
        assert!(matches!(r.lookup(at(3999 << 24 | 64)), Direct::Live { .. }));
    }
}
