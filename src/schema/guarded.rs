//! Guarded slots: small blocks that end against an inaccessible page, so that reading or
//! writing past a block's end faults at the first byte over (what guarded sampling places a
//! sampled allocation in; see `crate::allocator::guarded`).
//!
//! The area is one reservation of address space, made on first use, whose 2 MiB segments are
//! committed one at a time. A segment's first page is its header: the tag word every small
//! block segment starts with (here [`GUARDED_TAG`], which no allocator has, so that the tag
//! test of a free sends a guarded block off the fast path), then one record per slot. The
//! rest of the segment is slots of two pages each: a data page, committed when the slot is
//! first used, and a guard page that is never made accessible. A block of `size` bytes at
//! alignment `align` starts at `data_end - round_up(size, align)`, so its last byte is the
//! last one before the guard page when `size` is a multiple of `align` (as the layouts of
//! Rust types are); any padding between the two is filled with a pattern that the free
//! checks.
//!
//! A freed block is filled with another pattern and its slot waits in a FIFO before reuse,
//! so that a write after free has time to land while the slot is still checked: the
//! pattern is verified when the slot is handed out again.
//!
//! Steady state costs no system call: a slot keeps its data page when freed (only
//! [`GuardedArea::trim`] gives the pages of resting slots back). Nothing here allocates; the
//! records live in the segment headers, so the fault handler can read them without a lock.

use crate::os::{OsAllocator, PageSource};
use crate::schema::hpha::Tag;
use crate::sync::SpinLock;
use core::alloc::Layout;
use core::ptr::{self, NonNull};
use core::sync::atomic::{AtomicU8, AtomicU16, AtomicU32, AtomicUsize, Ordering::*};

/// The segment tag of guarded segments: no allocator's (tags are handed out from 1 up,
/// `Tag::MAX` marks the idle lane and `Tag::MAX - 1` a lane that asks).
pub const GUARDED_TAG: Tag = Tag::MAX - 2;

/// The page size the layout below assumes; elsewhere the area stays off.
const PAGE: usize = 4096;
/// A segment: the unit committed at once, aligned so a block's segment base is found by
/// masking (as for the small-block heap's segments).
const SEGMENT: usize = 2 * 1024 * 1024;
/// A slot: a data page and its guard page.
const SLOT: usize = 2 * PAGE;
/// Slots per segment, after the header page.
pub(crate) const SLOTS_PER_SEGMENT: usize = (SEGMENT - PAGE) / SLOT;
/// Where the slot records start in a header (after the tag word).
const RECORDS_AT: usize = 16;
/// Segments the reservation holds: 512 MiB of address space, 65,280 slots.
const MAX_SEGMENTS: usize = 256;
/// Bytes of address space reserved.
pub(crate) const AREA_BYTES: usize = MAX_SEGMENTS * SEGMENT;
/// The largest block a slot holds (and the largest alignment).
pub const MAX_GUARDED: usize = PAGE;
/// Where the area is asked to go: low in the address space, below where the kernel maps
/// (top-down, from under the stack) the heap's segments, so that a free of an ordinary
/// block tells it is no guarded one with a single compare against [`GuardedArea::end`]
/// (the thread caches' lane 0, see `Lane::plain_from`). Only a hint: elsewhere, frees of
/// blocks below the area take the longer test, nothing more.
const LOW_HINT: usize = if usize::BITS == 64 { 1 << 32 } else { 0 };
/// Freed slots that rest before one is reused (while fresh slots remain, none is).
const QUARANTINE: u32 = 64;

/// What a freed block is filled with.
pub(crate) const FREED_FILL: u8 = 0xdf;
/// What the padding between a block's end and its guard page is filled with.
pub(crate) const PAD_FILL: u8 = 0xcb;
/// The base address before the area is reserved: no user address is within
/// [`AREA_BYTES`] of it, so [`GuardedArea::contains`] is one subtraction and one compare.
const UNRESERVED: usize = 1 << 63;

const NEVER_USED: u8 = 0;
const LIVE: u8 = 1;
const FREED: u8 = 2;
/// Freed, and its data page given back to the OS (reads as zero: nothing to verify).
const TRIMMED: u8 = 3;

/// One slot's record, in its segment's header. Atomics, because the fault handler reads
/// them without the lock; every write is made under the area's lock.
#[repr(C)]
struct SlotRecord {
    state: AtomicU8,
    _pad: u8,
    tag: AtomicU16,
    /// The block's start, from the data page's start.
    offset: AtomicU16,
    /// The size requested (live) or last requested (freed).
    size: AtomicU16,
    /// The next slot in the free FIFO, as a slot number + 1 (0: none).
    next: AtomicU32,
    _spare: u32,
}

const _: () = assert!(size_of::<SlotRecord>() == 16);
const _: () = assert!(RECORDS_AT + SLOTS_PER_SEGMENT * 16 <= PAGE);

/// What the lock protects.
struct Slots {
    /// Segments committed (their headers writable).
    segments: usize,
    /// The next never-used slot number.
    fresh: u32,
    /// The free FIFO: oldest first, as slot number + 1 (0: empty).
    head: u32,
    tail: u32,
    resting: u32,
}

/// A guarded block as its record describes it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GuardedBlock {
    /// Its start.
    pub start: usize,
    /// The bytes from its start to the guard page (the size, rounded up to the alignment).
    pub usable: usize,
    /// The size requested.
    pub size: usize,
    /// The allocator tag it was allocated for.
    pub tag: Tag,
    /// Whether it is live (else freed).
    pub live: bool,
}

/// Where a faulting address lies in the area.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GuardedFault {
    /// In the guard page after `block`'s slot, `past_end` bytes after its end.
    PastEnd {
        block: GuardedBlock,
        past_end: usize,
    },
    /// Elsewhere in the area (a header, or a slot's unused guard page).
    Elsewhere,
}

/// What is wrong with a free.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GuardedMisuse {
    /// Not a block's start: in a header, a guard page, or inside a block.
    NotABlock,
    /// The block was already freed.
    DoubleFree(GuardedBlock),
    /// The padding after the block was written: `at` bytes after its end.
    WrittenPastEnd { block: GuardedBlock, at: usize },
}

/// A write after free found when a slot was reused: the block as it was, and the offset
/// of the first changed byte.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WrittenAfterFree {
    pub block: GuardedBlock,
    pub at: usize,
}

/// The guarded slots of a process (one static instance backs the `SystemAllocator`).
pub struct GuardedArea {
    base: AtomicUsize,
    slots: SpinLock<Slots>,
    /// Segments whose header is committed: a copy of the count under the lock, for the
    /// readers that take no lock (the fault handler, [`block`](Self::block)).
    segments_committed: AtomicUsize,
    live_blocks: AtomicUsize,
    live_bytes: AtomicUsize,
    allocations: AtomicUsize,
    frees: AtomicUsize,
    committed: AtomicUsize,
}

/// The area's counters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GuardedStats {
    /// Live guarded blocks.
    pub live_blocks: usize,
    /// Their usable bytes.
    pub live_bytes: usize,
    /// Guarded blocks handed out so far.
    pub allocations: usize,
    /// And freed.
    pub frees: usize,
    /// Bytes committed from the OS (headers and data pages).
    pub committed_bytes: usize,
}

impl GuardedArea {
    pub const fn new() -> Self {
        Self {
            base: AtomicUsize::new(UNRESERVED),
            slots: SpinLock::new(Slots {
                segments: 0,
                fresh: 0,
                head: 0,
                tail: 0,
                resting: 0,
            }),
            segments_committed: AtomicUsize::new(0),
            live_blocks: AtomicUsize::new(0),
            live_bytes: AtomicUsize::new(0),
            allocations: AtomicUsize::new(0),
            frees: AtomicUsize::new(0),
            committed: AtomicUsize::new(0),
        }
    }

    /// Whether `addr` lies in the area (reserved or not yet: never then).
    #[inline(always)]
    pub fn contains(&self, addr: usize) -> bool {
        addr.wrapping_sub(self.base.load(Relaxed)) < AREA_BYTES
    }

    /// The first address past the area, and so past every guarded block; while the area
    /// is not reserved, an address above every user address (no block can be above it).
    pub fn end(&self) -> usize {
        self.base.load(Acquire).wrapping_add(AREA_BYTES)
    }

    /// Reserves the area's address space now (it is otherwise reserved at the first
    /// guarded allocation); `false` if it cannot be. Done when guarding is turned on, so
    /// that [`end`](Self::end) is final before the thread caches' free paths read it.
    pub fn reserve(&self) -> bool {
        self.reserved_base().is_some()
    }

    /// Whether a block of `layout` fits a slot.
    pub fn fits(layout: Layout) -> bool {
        layout.size() != 0 && layout.size() <= MAX_GUARDED && layout.align() <= MAX_GUARDED
    }

    /// The counters.
    pub fn stats(&self) -> GuardedStats {
        GuardedStats {
            live_blocks: self.live_blocks.load(Relaxed),
            live_bytes: self.live_bytes.load(Relaxed),
            allocations: self.allocations.load(Relaxed),
            frees: self.frees.load(Relaxed),
            committed_bytes: self.committed.load(Relaxed),
        }
    }

    /// A block of `layout` for allocator `tag`, ending at a guard page; `None` if the layout
    /// does not fit a slot, the page size is not 4 KiB, or no slot is free and none can be
    /// committed. `Err` reports a write after free found in the slot it was about to reuse
    /// (the slot is then left out of use).
    pub fn allocate(
        &self,
        layout: Layout,
        tag: Tag,
    ) -> Result<Option<NonNull<u8>>, WrittenAfterFree> {
        if !Self::fits(layout) {
            return Ok(None);
        }
        let Some(base) = self.reserved_base() else {
            return Ok(None);
        };
        let usable = layout.size().next_multiple_of(layout.align());
        let mut slots = self.slots.lock();
        let Some(slot) = self.take_slot(&mut slots, base) else {
            return Ok(None);
        };
        let data = data_page(base, slot);
        let record = record_of(base, slot);
        // SAFETY: the record lies in a committed header (the slot was handed out).
        let record = unsafe { &*record };
        if record.state.load(Relaxed) == FREED {
            let was = block_of(data, record);
            // SAFETY: the data page is committed and the slot free: nobody else uses it.
            let bytes = unsafe { core::slice::from_raw_parts(was.start as *const u8, was.usable) };
            if let Some(at) = first_unlike(bytes, FREED_FILL) {
                // Left out of use: neither free nor live, so never handed out again.
                record.state.store(LIVE, Relaxed);
                record.size.store(was.size as u16, Relaxed);
                return Err(WrittenAfterFree { block: was, at });
            }
        }
        let start = data + PAGE - usable;
        record.tag.store(tag, Relaxed);
        record.offset.store((start - data) as u16, Relaxed);
        record.size.store(layout.size() as u16, Relaxed);
        record.next.store(0, Relaxed);
        record.state.store(LIVE, Release);
        drop(slots);
        // SAFETY: the padding lies inside the slot's committed data page, now ours.
        unsafe {
            ptr::write_bytes(
                (start + layout.size()) as *mut u8,
                PAD_FILL,
                usable - layout.size(),
            )
        };
        self.live_blocks.fetch_add(1, Relaxed);
        self.live_bytes.fetch_add(usable, Relaxed);
        self.allocations.fetch_add(1, Relaxed);
        Ok(NonNull::new(start as *mut u8))
    }

    /// Frees the block at `ptr`: checks that it is a live block's start and that its
    /// padding is intact, fills it and lets its slot rest. Returns the block as it was.
    pub fn free(&self, ptr: *mut u8) -> Result<GuardedBlock, GuardedMisuse> {
        let addr = ptr.addr();
        let Some(base) = self.base_if_contains(addr) else {
            return Err(GuardedMisuse::NotABlock);
        };
        let Some((slot, _)) = slot_at(base, addr) else {
            return Err(GuardedMisuse::NotABlock);
        };
        let mut slots = self.slots.lock();
        if slot >= slots.fresh {
            return Err(GuardedMisuse::NotABlock);
        }
        // SAFETY: a handed-out slot's header is committed.
        let record = unsafe { &*record_of(base, slot) };
        let block = block_of(data_page(base, slot), record);
        match record.state.load(Relaxed) {
            LIVE if block.start == addr => {}
            FREED | TRIMMED if block.start == addr => {
                return Err(GuardedMisuse::DoubleFree(block));
            }
            _ => return Err(GuardedMisuse::NotABlock),
        }
        // SAFETY: the block is live and ours to check and fill; the padding follows it in
        // the same data page.
        unsafe {
            let pad = core::slice::from_raw_parts(
                (addr + block.size) as *const u8,
                block.usable - block.size,
            );
            if let Some(at) = pad.iter().position(|&b| b != PAD_FILL) {
                return Err(GuardedMisuse::WrittenPastEnd { block, at });
            }
            ptr::write_bytes(ptr, FREED_FILL, block.usable);
        }
        record.state.store(FREED, Release);
        push_free(&mut slots, base, slot);
        drop(slots);
        self.live_blocks.fetch_sub(1, Relaxed);
        self.live_bytes.fetch_sub(block.usable, Relaxed);
        self.frees.fetch_add(1, Relaxed);
        Ok(block)
    }

    /// The live block starting at `ptr`, if there is one. Takes no lock: a block the caller
    /// owns does not change under it.
    pub fn block(&self, ptr: *const u8) -> Option<GuardedBlock> {
        let base = self.base_if_contains(ptr.addr())?;
        let (slot, in_guard) = slot_at(base, ptr.addr())?;
        let record = self.committed_record(base, slot)?;
        let block = block_of(data_page(base, slot), record);
        (!in_guard && block.live && block.start == ptr.addr()).then_some(block)
    }

    /// Slot `slot`'s record, if its segment's header is committed (a header is never
    /// decommitted, and is committed before any of its slots is handed out).
    fn committed_record(&self, base: usize, slot: u32) -> Option<&SlotRecord> {
        let segment = slot as usize / SLOTS_PER_SEGMENT;
        if segment >= self.segments_committed.load(Acquire) {
            return None;
        }
        // SAFETY: the segment's header is committed (and stays so).
        Some(unsafe { &*record_of(base, slot) })
    }

    /// What a fault at `addr` hit, if it lies in the area. Takes no lock and writes nothing
    /// (for a signal handler): the records may be changing, so the answer is as good as
    /// the moment.
    pub fn fault_at(&self, addr: usize) -> Option<GuardedFault> {
        let base = self.base_if_contains(addr)?;
        let Some((slot, true)) = slot_at(base, addr) else {
            return Some(GuardedFault::Elsewhere);
        };
        let Some(record) = self.committed_record(base, slot) else {
            return Some(GuardedFault::Elsewhere);
        };
        if record.state.load(Acquire) == NEVER_USED {
            return Some(GuardedFault::Elsewhere);
        }
        let block = block_of(data_page(base, slot), record);
        let end = block.start + block.usable;
        Some(GuardedFault::PastEnd {
            block,
            past_end: addr.saturating_sub(end),
        })
    }

    /// Gives the data pages of resting slots back to the OS (they read as zero after);
    /// returns the bytes given back.
    pub fn trim(&self) -> usize {
        let Some(base) = self.base_if_reserved() else {
            return 0;
        };
        let slots = self.slots.lock();
        let mut given = 0;
        let mut next = slots.head;
        while next != 0 {
            let slot = next - 1;
            // SAFETY: slots in the FIFO have committed headers and data pages.
            let record = unsafe { &*record_of(base, slot) };
            if record.state.load(Relaxed) == FREED {
                // SAFETY: the slot is free; its data page is one committed page of ours.
                if unsafe { OsAllocator.purge(data_page(base, slot) as *mut u8, PAGE) } {
                    record.state.store(TRIMMED, Relaxed);
                    given += PAGE;
                }
            }
            next = record.next.load(Relaxed);
        }
        given
    }

    /// Takes the lock and keeps it (before `fork()`).
    ///
    /// # Safety
    /// [`release_after_fork`](Self::release_after_fork) must follow, once.
    pub(crate) unsafe fn hold_for_fork(&self) {
        // SAFETY: forwarded from the caller.
        unsafe { self.slots.lock_raw() };
    }

    /// Releases the lock [`hold_for_fork`](Self::hold_for_fork) took.
    ///
    /// # Safety
    /// After `hold_for_fork` on this thread (or in the child it forked), once.
    pub(crate) unsafe fn release_after_fork(&self) {
        // SAFETY: forwarded from the caller.
        unsafe { self.slots.force_unlock() };
    }

    fn base_if_reserved(&self) -> Option<usize> {
        let base = self.base.load(Acquire);
        (base != UNRESERVED).then_some(base)
    }

    fn base_if_contains(&self, addr: usize) -> Option<usize> {
        let base = self.base.load(Acquire);
        (addr.wrapping_sub(base) < AREA_BYTES).then_some(base)
    }

    /// The area's base, reserving it on first use.
    fn reserved_base(&self) -> Option<usize> {
        if let Some(base) = self.base_if_reserved() {
            return Some(base);
        }
        if OsAllocator::page_size() != PAGE {
            return None;
        }
        let slots = self.slots.lock();
        if let Some(base) = self.base_if_reserved() {
            return Some(base);
        }
        let p = OsAllocator::reserve(AREA_BYTES, SEGMENT, LOW_HINT);
        drop(slots);
        if p.is_null() {
            return None;
        }
        self.base.store(p.addr(), Release);
        Some(p.addr())
    }

    /// A slot to use: a rested one if enough rest, else a fresh one (committing its page,
    /// and its segment's header first), else the oldest resting one.
    fn take_slot(&self, slots: &mut Slots, base: usize) -> Option<u32> {
        if slots.resting > QUARANTINE {
            return pop_free(slots, base);
        }
        let total = (MAX_SEGMENTS * SLOTS_PER_SEGMENT) as u32;
        if slots.fresh < total {
            let slot = slots.fresh;
            let segment = slot as usize / SLOTS_PER_SEGMENT;
            if segment == slots.segments {
                let header = (base + segment * SEGMENT) as *mut u8;
                // SAFETY: the header page of a segment of our reservation, not committed yet.
                if !unsafe { OsAllocator::commit(header, PAGE) } {
                    return pop_free(slots, base);
                }
                // SAFETY: just committed; the tag word is the segment's first.
                unsafe { header.cast::<Tag>().write(GUARDED_TAG) };
                self.committed.fetch_add(PAGE, Relaxed);
                slots.segments += 1;
                self.segments_committed.store(slots.segments, Release);
            }
            let data = data_page(base, slot) as *mut u8;
            // SAFETY: a never-used slot's data page: inside the reservation, not committed.
            if !unsafe { OsAllocator::commit(data, PAGE) } {
                return pop_free(slots, base);
            }
            self.committed.fetch_add(PAGE, Relaxed);
            slots.fresh += 1;
            return Some(slot);
        }
        pop_free(slots, base)
    }
}

impl Default for GuardedArea {
    fn default() -> Self {
        Self::new()
    }
}

/// The offset of the first byte of `bytes` that is not `fill`: eight bytes at a time
/// (a freed 4 KiB block is checked on every reuse of its slot).
fn first_unlike(bytes: &[u8], fill: u8) -> Option<usize> {
    let word = u64::from_ne_bytes([fill; 8]);
    let mut chunks = bytes.chunks_exact(8);
    let mut at = 0;
    for chunk in &mut chunks {
        // The chunk is exactly 8 bytes long.
        if u64::from_ne_bytes(chunk.try_into().unwrap_or([0; 8])) != word {
            break;
        }
        at += 8;
    }
    bytes[at..].iter().position(|&b| b != fill).map(|i| at + i)
}

/// The start of slot `slot`'s data page.
fn data_page(base: usize, slot: u32) -> usize {
    let slot = slot as usize;
    base + (slot / SLOTS_PER_SEGMENT) * SEGMENT + PAGE + (slot % SLOTS_PER_SEGMENT) * SLOT
}

/// Slot `slot`'s record.
fn record_of(base: usize, slot: u32) -> *const SlotRecord {
    let slot = slot as usize;
    (base + (slot / SLOTS_PER_SEGMENT) * SEGMENT + RECORDS_AT + (slot % SLOTS_PER_SEGMENT) * 16)
        as *const SlotRecord
}

/// The slot whose data or guard page holds `addr`, and whether it is the guard page; `None`
/// for a header or the unused page at a segment's end.
fn slot_at(base: usize, addr: usize) -> Option<(u32, bool)> {
    let off = addr - base;
    let in_segment = off % SEGMENT;
    if in_segment < PAGE {
        return None;
    }
    let index = (in_segment - PAGE) / SLOT;
    if index >= SLOTS_PER_SEGMENT {
        return None;
    }
    let slot = (off / SEGMENT) * SLOTS_PER_SEGMENT + index;
    Some((slot as u32, (in_segment - PAGE) % SLOT >= PAGE))
}

/// The block a record describes, in the slot whose data page starts at `data`.
fn block_of(data: usize, record: &SlotRecord) -> GuardedBlock {
    let start = data + usize::from(record.offset.load(Relaxed));
    GuardedBlock {
        start,
        usable: data + PAGE - start,
        size: usize::from(record.size.load(Relaxed)),
        tag: record.tag.load(Relaxed),
        live: record.state.load(Relaxed) == LIVE,
    }
}

fn push_free(slots: &mut Slots, base: usize, slot: u32) {
    let link = slot + 1;
    if slots.tail == 0 {
        slots.head = link;
    } else {
        // SAFETY: the tail slot's header is committed.
        unsafe { (*record_of(base, slots.tail - 1)).next.store(link, Relaxed) };
    }
    slots.tail = link;
    slots.resting += 1;
}

fn pop_free(slots: &mut Slots, base: usize) -> Option<u32> {
    if slots.head == 0 {
        return None;
    }
    let slot = slots.head - 1;
    // SAFETY: a slot in the FIFO has a committed header.
    let next = unsafe { (*record_of(base, slot)).next.load(Relaxed) };
    slots.head = next;
    if next == 0 {
        slots.tail = 0;
    }
    slots.resting -= 1;
    Some(slot)
}

// Not under Miri: the area is real reserved address space with PROT_NONE pages.
#[cfg(all(test, not(miri)))]
mod tests {
    use super::*;

    fn layout(size: usize, align: usize) -> Layout {
        Layout::from_size_align(size, align).unwrap()
    }

    #[test]
    fn blocks_end_at_the_guard_page_and_pad_to_their_alignment() {
        let area = GuardedArea::new();
        for (size, align) in [(1, 1), (24, 8), (4096, 1), (100, 64), (5, 4), (4096, 4096)] {
            let p = area.allocate(layout(size, align), 7).unwrap().unwrap();
            let addr = p.as_ptr().addr();
            assert_eq!(addr % align, 0);
            let usable = size.next_multiple_of(align);
            assert_eq!(
                (addr + usable) % PAGE,
                0,
                "{size}/{align} ends at a page end"
            );
            let block = area.block(p.as_ptr()).unwrap();
            assert_eq!((block.size, block.usable, block.tag), (size, usable, 7));
            // The whole block is writable.
            // SAFETY: a live block of `size` bytes.
            unsafe { p.as_ptr().write_bytes(0x11, size) };
            match area.fault_at(addr + usable) {
                Some(GuardedFault::PastEnd { block: b, past_end }) => {
                    assert_eq!((b.start, past_end), (addr, 0));
                }
                other => panic!("{other:?}"),
            }
            assert_eq!(area.free(p.as_ptr()).unwrap().start, addr);
        }
        assert_eq!(area.stats().live_blocks, 0);
    }

    #[test]
    fn a_write_past_the_end_faults() {
        let area = GuardedArea::new();
        let p = area.allocate(layout(64, 8), 1).unwrap().unwrap();
        // SAFETY: one past the 64-byte block: the guard page's first byte, in the area.
        let guard = unsafe { p.as_ptr().add(64) };
        // Probed without faulting: the kernel's copy into our own address space
        // (`process_vm_writev` to our pid) fails with EFAULT on an inaccessible page.
        let byte = [0u8; 1];
        let local = libc::iovec {
            iov_base: byte.as_ptr() as *mut _,
            iov_len: 1,
        };
        let remote = libc::iovec {
            iov_base: guard.cast(),
            iov_len: 1,
        };
        // SAFETY: the kernel checks the remote range and fails with EFAULT; the iovecs are
        // valid for the call.
        let rc = unsafe { libc::process_vm_writev(libc::getpid(), &local, 1, &remote, 1, 0) };
        assert_eq!(rc, -1, "the guard page must be inaccessible");
        let inside = libc::iovec {
            // SAFETY: the block's last byte.
            iov_base: unsafe { guard.sub(1) }.cast(),
            iov_len: 1,
        };
        // SAFETY: writes one byte of a live block of ours.
        let rc = unsafe { libc::process_vm_writev(libc::getpid(), &local, 1, &inside, 1, 0) };
        assert_eq!(rc, 1, "the block's last byte is writable");
        area.free(p.as_ptr()).unwrap();
    }

    #[test]
    fn misuse_is_named() {
        let area = GuardedArea::new();
        let p = area.allocate(layout(20, 4), 3).unwrap().unwrap();
        assert_eq!(
            // SAFETY: inside the 20-byte block.
            area.free(unsafe { p.as_ptr().add(4) }),
            Err(GuardedMisuse::NotABlock)
        );
        // The padding of a 20/4 block: none. A 21/4 block has 3 bytes of it.
        let q = area.allocate(layout(21, 4), 3).unwrap().unwrap();
        // SAFETY: the padding lies in the block's data page, before the guard page.
        unsafe { q.as_ptr().add(22).write(1) };
        match area.free(q.as_ptr()) {
            Err(GuardedMisuse::WrittenPastEnd { at, block }) => {
                assert_eq!((at, block.size, block.usable), (1, 21, 24));
            }
            other => panic!("{other:?}"),
        }
        let block = area.free(p.as_ptr()).unwrap();
        assert_eq!(
            area.free(p.as_ptr()),
            Err(GuardedMisuse::DoubleFree(GuardedBlock {
                live: false,
                ..block
            }))
        );
        let outside = [0u8; 4];
        assert_eq!(
            area.free(outside.as_ptr().cast_mut()),
            Err(GuardedMisuse::NotABlock)
        );
    }

    #[test]
    fn slots_rest_before_reuse_and_a_write_after_free_is_found() {
        let area = GuardedArea::new();
        let first = area.allocate(layout(48, 8), 2).unwrap().unwrap();
        area.free(first.as_ptr()).unwrap();
        // Fresh slots are used while the first one rests.
        let mut live = Vec::new();
        for _ in 0..QUARANTINE {
            let p = area.allocate(layout(48, 8), 2).unwrap().unwrap();
            assert_ne!(p, first);
            live.push(p);
        }
        for p in live.drain(..) {
            area.free(p.as_ptr()).unwrap();
        }
        // Past the quarantine the oldest resting slot comes back: the first. Write into it.
        // SAFETY: the freed slot's data page stays committed while it rests.
        unsafe { first.as_ptr().add(40).write(7) };
        let got = area.allocate(layout(48, 8), 2);
        match got {
            Err(WrittenAfterFree { block, at }) => {
                assert_eq!(
                    (block.start, block.size, at),
                    (first.as_ptr().addr(), 48, 40)
                );
            }
            other => panic!("{other:?}"),
        }
        // The slot stays out of use; the next allocation gets another, clean one.
        let next = area.allocate(layout(48, 8), 2).unwrap().unwrap();
        assert_ne!(next, first);
        area.free(next.as_ptr()).unwrap();
    }

    #[test]
    fn trimmed_slots_are_reused_without_a_check() {
        let area = GuardedArea::new();
        let ps: Vec<_> = (0..QUARANTINE + 2)
            .map(|_| area.allocate(layout(16, 8), 1).unwrap().unwrap())
            .collect();
        for p in &ps {
            area.free(p.as_ptr()).unwrap();
        }
        assert_eq!(area.trim(), (QUARANTINE as usize + 2) * PAGE);
        let again = area.allocate(layout(16, 8), 1).unwrap().unwrap();
        assert_eq!(
            again.as_ptr().addr() & !(PAGE - 1),
            ps[0].as_ptr().addr() & !(PAGE - 1)
        );
        assert_eq!(
            area.stats().committed_bytes,
            PAGE + (QUARANTINE as usize + 2) * PAGE
        );
        area.free(again.as_ptr()).unwrap();
    }

    #[test]
    fn first_unlike_finds_the_first_changed_byte() {
        for len in [0usize, 1, 7, 8, 9, 63, 64, 4096] {
            let mut bytes = vec![FREED_FILL; len];
            assert_eq!(first_unlike(&bytes, FREED_FILL), None);
            for at in [0, len / 2, len.saturating_sub(1)] {
                if at < len {
                    bytes[at] = 0;
                    assert_eq!(first_unlike(&bytes, FREED_FILL), Some(at), "{len} {at}");
                    bytes[at] = FREED_FILL;
                }
            }
        }
    }

    #[test]
    fn the_segment_tag_is_no_allocators() {
        let area = GuardedArea::new();
        let p = area.allocate(layout(8, 8), 5).unwrap().unwrap();
        let seg = p.as_ptr().addr() & !(SEGMENT - 1);
        // SAFETY: the segment's header page is committed once a slot of it is handed out.
        assert_eq!(unsafe { *(seg as *const Tag) }, GUARDED_TAG);
        assert!(area.contains(p.as_ptr().addr()));
        assert!(!area.contains(seg + AREA_BYTES));
        assert!(!GuardedArea::new().contains(p.as_ptr().addr()));
        area.free(p.as_ptr()).unwrap();
    }

    #[test]
    fn slot_geometry() {
        assert_eq!(SLOTS_PER_SEGMENT, 255);
        let base = 1 << 30;
        for slot in [0u32, 1, 254, 255, 1000] {
            let data = data_page(base, slot);
            assert_eq!(slot_at(base, data), Some((slot, false)));
            assert_eq!(slot_at(base, data + PAGE - 1), Some((slot, false)));
            assert_eq!(slot_at(base, data + PAGE), Some((slot, true)));
        }
        assert_eq!(slot_at(base, base), None);
        assert_eq!(slot_at(base, base + SEGMENT - 1), None);
    }
}
