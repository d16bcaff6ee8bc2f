//! Virtual blocks: offsets in a range of memory the allocator never touches.
//!
//! A [`VirtualBlock`] hands out `[offset, offset + size)` ranges of a block whose memory lives
//! elsewhere: GPU memory, uncached or device memory, a file, or one big buffer. All of its
//! bookkeeping is ordinary Rust data outside that memory, so it works where an allocator with
//! in-band headers (rlsf, dlmalloc) cannot. It is the Rust counterpart of VMA's and D3D12MA's
//! virtual blocks and of O3DE's `BestFitExternalMapSchema` (see [`ExternalMapAllocator`] for
//! the pointer-based form).
//!
//! - Sizes and offsets are `u64` in any unit; alignments are powers of two.
//! - Two algorithms: [`Algorithm::Tlsf`], an O(1) good-fit allocator with
//!   [strategies](Strategy), and [`Algorithm::Linear`] for free-at-once, stack, double-stack
//!   and ring-buffer use.
//! - **No false out-of-memory** with TLSF: when any free range can hold the request after
//!   alignment, the allocation succeeds. (OffsetAllocator and O3DE's original can fail here.)
//! - Handles ([`Alloc`]) are 16 bytes: the offset, a record number and a stamp unique to
//!   the block, so freeing a stale or foreign handle is a typed [`Error`], not corruption.
//! - Alignment 0 means 1, as in VMA.
//! - Per-allocation user data (the type parameter `U`), an optional name and a [`Tag`]
//!   (a literal, or a name made at run time with [`Tag::intern`]).
//! - O(1) [`statistics`](VirtualBlock::statistics), the exact
//!   [`largest_free`](VirtualBlock::largest_free) range, a
//!   [`fragmentation`](VirtualBlock::fragmentation) metric,
//!   [`detailed statistics`](VirtualBlock::detailed_statistics) with VMA's fields, JSON in
//!   VMA's virtual-block shape ([`to_json`](VirtualBlock::to_json)), VMA's full dump shape
//!   for a set of blocks, which VMA's `GpuMemDumpVis.py` draws ([`gpu_mem_dump`]), and an
//!   SVG memory map that shows free space at every scale ([`to_svg`](VirtualBlock::to_svg),
//!   [`memory_map_svg`]).
//! - [`grow`](VirtualBlock::grow) in place, [`clear`](VirtualBlock::clear) at once, and
//!   defragmentation in passes ([`defrag_pass`](VirtualBlock::defrag_pass)).
//!
//! A block has no internal locking, like VMA's: every change takes `&mut self`, so share one
//! between threads behind a `Mutex`.
//!
//! ```
//! use tagalloc::virtual_block::{Request, Tag, VirtualBlock};
//!
//! // A pretend 64 MiB GPU heap; user data is a resource id.
//! let mut heap: VirtualBlock<u32> = VirtualBlock::new(64 << 20);
//! let textures = Tag::new("textures");
//! let a = heap.allocate(&Request::new(3 << 20).align(64 << 10).tag(textures).name("albedo"), 7)?;
//! assert_eq!(a.offset() % (64 << 10), 0);
//! assert_eq!(heap.info(a)?.name, Some("albedo"));
//! assert_eq!(heap.statistics().allocation_bytes, 3 << 20);
//! assert_eq!(heap.free(a)?, 7);
//! assert!(heap.free(a).is_err()); // stale handle: a typed error, not corruption
//! heap.validate()?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

mod defrag;
mod facade;
mod fit_summary;
mod gpu_dump;
pub(crate) mod json;
mod linear;
mod stats;
mod svg;
mod tag_names;
#[cfg(test)]
mod tests;
mod tlsf;

use std::collections::HashMap;
use std::fmt;
use std::num::NonZeroU32;
use std::sync::atomic::{AtomicU32, Ordering};

pub use defrag::{DefragLimits, Move};
pub use facade::{ExternalMapAllocator, FacadeStatistics};
pub use gpu_dump::{DumpBlock, DumpedAllocation, ResourceKind, gpu_mem_dump};
pub use stats::{DetailedStatistics, Statistics, TagStatistics};
pub use svg::{MapRow, memory_map_svg};

use linear::{Linear, LinearFail};
use tlsf::{NIL, NodeKind, Tlsf};

/// How a block places allocations. Chosen when the block is created.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum Algorithm {
    /// Two-level segregated fit: O(1) good fit, any allocation and free order, no false
    /// out-of-memory. The default.
    #[default]
    Tlsf,
    /// Allocations only at the ends: free-at-once, stack, double stack (with
    /// [`Request::upper_address`]) or ring buffer. The cheapest possible bookkeeping, but space
    /// freed in the middle is reused only once the ends reach it.
    Linear,
}

/// Which free range a TLSF allocation takes. Ignored by the linear algorithm.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum Strategy {
    /// O(1) good fit: first the head of the size class of the request's size rounded up to
    /// its alignment, if it fits (a tight fit), else the head of the smallest size class
    /// whose every range fits even with worst-case padding; an exact search only when both
    /// find nothing. Fast, with little fragmentation.
    #[default]
    Balanced,
    /// The head of the smallest size class whose every range fits, without the tight-fit
    /// check: one memory access fewer, slightly looser packing. (VMA's `STRATEGY_MIN_TIME`.)
    MinTime,
    /// Best fit: the smallest free range that fits, searched from the request's own size
    /// class upwards. The walk examines at most 64 free ranges (many small ones can fail an
    /// alignment), then settles for the best seen or falls back to `Balanced`: tightest
    /// packing, slower. (VMA's `STRATEGY_MIN_MEMORY`.)
    MinMemory,
    /// The fitting free range with the lowest offset: packs allocations towards the start.
    /// O(free ranges). (VMA's `STRATEGY_MIN_OFFSET`.)
    MinOffset,
}

/// A category an allocation belongs to, such as "textures" or "vertex buffers".
///
/// Tags colour the [SVG memory map](VirtualBlock::to_svg), appear in the JSON and are summed by
/// [`VirtualBlock::tag_statistics`]. A tag is a `'static` name, so it is `Copy` and costs a
/// pointer to carry; two tags are equal when their names are.
///
/// ```
/// use tagalloc::virtual_block::Tag;
/// const TEXTURES: Tag = Tag::new("textures"); // a literal: no copy at all
/// let pool = 3;
/// let streaming = Tag::intern(&format!("streaming pool {pool}")); // made at run time
/// assert_eq!(streaming.name(), "streaming pool 3");
/// assert_eq!(streaming, Tag::intern("streaming pool 3"));
/// assert_ne!(streaming, TEXTURES);
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Tag(&'static str);

impl Tag {
    /// A tag with this name.
    pub const fn new(name: &'static str) -> Self {
        Tag(name)
    }

    /// A tag whose name is made at run time. The name is copied once into a process-wide
    /// table and kept for the life of the process: the same name always gives back the same
    /// copy, so the table grows with the number of distinct names, not of calls. The table
    /// lives in pages from tagalloc's OS layer, never the global allocator, so this may be
    /// called from allocator code. Takes a lock; make the tag once and keep it rather than
    /// calling this for every allocation. (Aborts, as the standard library does, if the OS
    /// refuses the few pages it needs.)
    pub fn intern(name: &str) -> Self {
        Tag(tag_names::intern(name))
    }

    /// The tag's name.
    pub const fn name(self) -> &'static str {
        self.0
    }

    /// Same name: the same pointer (the same literal or interned copy) first, then the text.
    #[inline(always)]
    fn same(self, other: Tag) -> bool {
        (self.0.as_ptr() == other.0.as_ptr() && self.0.len() == other.0.len()) || self.0 == other.0
    }
}

/// What to allocate: size, alignment and options, built up with chained calls.
///
/// ```
/// use tagalloc::virtual_block::{Request, Strategy, Tag};
/// let r = Request::new(256).align(64).strategy(Strategy::MinMemory).tag(Tag::new("mesh"));
/// assert_eq!(r.size(), 256);
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Request<'a> {
    size: u64,
    align: u64,
    strategy: Strategy,
    upper: bool,
    tag: Option<Tag>,
    name: Option<&'a str>,
}

impl<'a> Request<'a> {
    /// The request `allocate` passes on for one without tag or name (built where its fields
    /// are in registers).
    #[inline(always)]
    fn unlabelled(size: u64, align: u64, strategy: Strategy, upper: bool) -> Self {
        Self {
            size,
            align,
            strategy,
            upper,
            tag: None,
            name: None,
        }
    }

    /// A request for `size` units, aligned to 1, with the default strategy.
    pub const fn new(size: u64) -> Self {
        Request {
            size,
            align: 1,
            strategy: Strategy::Balanced,
            upper: false,
            tag: None,
            name: None,
        }
    }

    /// Sets the alignment of the offset: a power of two, or 0, which means 1 (as in VMA).
    pub const fn align(mut self, align: u64) -> Self {
        self.align = align;
        self
    }

    /// Sets the placement strategy (TLSF blocks only).
    pub const fn strategy(mut self, strategy: Strategy) -> Self {
        self.strategy = strategy;
        self
    }

    /// Allocates from the top of the block, growing down: the upper stack of a double stack.
    /// Only valid for [`Algorithm::Linear`] blocks.
    pub const fn upper_address(mut self) -> Self {
        self.upper = true;
        self
    }

    /// Sets the allocation's tag.
    pub const fn tag(mut self, tag: Tag) -> Self {
        self.tag = Some(tag);
        self
    }

    /// Sets the allocation's name; the block keeps a copy.
    pub const fn name(mut self, name: &'a str) -> Self {
        self.name = Some(name);
        self
    }

    /// The requested size.
    pub const fn size(&self) -> u64 {
        self.size
    }
}

/// A handle to one allocation of one block: 16 bytes (`Option<Alloc>` too), `Copy`, and
/// checked on every use.
///
/// Besides the offset it holds the allocation's record number and a 32-bit stamp. Each block
/// hands out odd stamps from its own counter, which starts at a point of the 32-bit circle
/// unique to the block (block numbers times the golden ratio: the starts of `n` blocks are at
/// least about 2³²/(3n) apart). So a handle that was freed (stale) is an [`Error::StaleHandle`], and one from
/// another block an [`Error::ForeignHandle`] while its stamp is outside the range this block
/// has issued; a foreign stamp inside it reads as stale, still an error. Using a handle can
/// only reach someone else's range if record number, offset and stamp all match a live
/// allocation of this block, which needs a foreign stamp inside this block's issued range
/// (blocks that between them made billions of allocations) *and* the same record at the
/// same offset. A committed defragmentation move retires the old handle and returns a new
/// one.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Alloc {
    offset: u64,
    /// The allocation's record: its TLSF node (which holds the stamp too, so `free` checks
    /// the handle on the cache line it must touch anyway) or its linear slot.
    id: u32,
    /// Drawn from the block's [`Stamps`] when the allocation was made.
    stamp: NonZeroU32,
}

impl Alloc {
    /// Where the allocation starts in the block.
    pub const fn offset(&self) -> u64 {
        self.offset
    }
}

/// Everything the block knows about one allocation, see [`VirtualBlock::info`].
#[derive(Debug, PartialEq, Eq)]
pub struct AllocInfo<'a, U> {
    /// The allocation's handle.
    pub handle: Alloc,
    /// Where it starts.
    pub offset: u64,
    /// Its size as requested.
    pub size: u64,
    /// The alignment it was requested with.
    pub align: u64,
    /// Its tag, if any.
    pub tag: Option<Tag>,
    /// Its name, if any.
    pub name: Option<&'a str>,
    /// The user data given at allocation.
    pub user: &'a U,
}

/// One range of a block, as listed by [`VirtualBlock::ranges`] in offset order.
#[derive(Debug, PartialEq, Eq)]
pub enum Range<'a, U> {
    /// A live allocation.
    Allocation(AllocInfo<'a, U>),
    /// Space held for the destination of a pending defragmentation [`Move`].
    Reserved {
        /// Start of the range.
        offset: u64,
        /// Length of the range.
        size: u64,
    },
    /// Free space (always maximal: two free ranges are never neighbours).
    Free {
        /// Start of the range.
        offset: u64,
        /// Length of the range.
        size: u64,
    },
}

impl<U> Range<'_, U> {
    /// Start of the range.
    pub fn offset(&self) -> u64 {
        match self {
            Range::Allocation(a) => a.offset,
            Range::Reserved { offset, .. } | Range::Free { offset, .. } => *offset,
        }
    }

    /// Length of the range.
    pub fn size(&self) -> u64 {
        match self {
            Range::Allocation(a) => a.size,
            Range::Reserved { size, .. } | Range::Free { size, .. } => *size,
        }
    }
}

/// Why an operation on a virtual block failed. Bad input never panics.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Error {
    /// A request for zero units.
    ZeroSize,
    /// An alignment that is neither a power of two nor 0 (which means 1).
    BadAlignment(u64),
    /// No free range can hold the request after alignment (for TLSF this is never a false
    /// alarm). The fields tell how far off it was; all of them cost O(1) to fill in, so a
    /// failure stays cheap however many allocations the block holds.
    OutOfSpace {
        /// Requested size.
        size: u64,
        /// Requested alignment.
        align: u64,
        /// Free units in the block.
        free_bytes: u64,
        /// A lower bound on the largest free range the block can allocate from. TLSF: the
        /// largest free range itself when its size class holds no other (the usual case),
        /// else that class's floor, at most 1/32 (about 3 %) below it
        /// ([`VirtualBlock::largest_free`] gives the exact size by scanning that class).
        /// Linear: the largest free space at the ends, exactly, which is all a linear block
        /// allocates from (space freed in the middle waits until an end reaches it).
        largest_free_at_least: u64,
    },
    /// [`Request::upper_address`] on a block that is not [`Algorithm::Linear`].
    UpperAddressNotLinear,
    /// [`Request::upper_address`] while a linear block is in use as a ring buffer.
    UpperAddressInRing,
    /// The handle's allocation was freed (or moved, or the block cleared).
    StaleHandle,
    /// The handle, move or address belongs to another block.
    ForeignHandle,
    /// More than 2³¹ TLSF regions (or `u32::MAX - 1` linear allocations).
    TooManyAllocations,
    /// More than 65 535 distinct tags in one block.
    TooManyTags,
    /// [`VirtualBlock::grow`] with a smaller size.
    CannotShrink {
        /// The block's size.
        capacity: u64,
        /// The size asked for.
        requested: u64,
    },
    /// Defragmentation of a linear block (allocations there cannot move).
    DefragUnsupported,
    /// A new defragmentation pass while moves of the previous one are neither committed nor
    /// rejected.
    DefragPending,
    /// A move that is not pending any more (already committed or rejected, or from an old
    /// pass).
    UnknownMove,
    /// A pointer that is not the start of a live allocation of this
    /// [`ExternalMapAllocator`].
    UnknownAddress,
    /// The managed range does not fit in the address space.
    AddressOverflow,
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::ZeroSize => f.write_str("zero-sized allocation"),
            Error::BadAlignment(a) => write!(f, "alignment {a} is not a power of two"),
            Error::OutOfSpace {
                size,
                align,
                free_bytes,
                largest_free_at_least,
            } => write!(
                f,
                "out of space for {size} units aligned to {align} ({free_bytes} free, \
                 largest usable free range at least {largest_free_at_least})"
            ),
            Error::UpperAddressNotLinear => {
                f.write_str("upper-address allocation needs the linear algorithm")
            }
            Error::UpperAddressInRing => {
                f.write_str("upper-address allocation while the block is a ring buffer")
            }
            Error::StaleHandle => f.write_str("stale handle: the allocation is gone"),
            Error::ForeignHandle => f.write_str("handle from another block"),
            Error::TooManyAllocations => f.write_str("too many allocations"),
            Error::TooManyTags => f.write_str("too many distinct tags in one block"),
            Error::CannotShrink {
                capacity,
                requested,
            } => {
                write!(f, "cannot shrink a block of {capacity} to {requested}")
            }
            Error::DefragUnsupported => f.write_str("linear blocks cannot be defragmented"),
            Error::DefragPending => f.write_str("the previous defragmentation pass has open moves"),
            Error::UnknownMove => f.write_str("move is not pending"),
            Error::UnknownAddress => f.write_str("address is not a live allocation"),
            Error::AddressOverflow => f.write_str("range does not fit in the address space"),
        }
    }
}

impl std::error::Error for Error {}

/// The user data of live allocations, by id.
///
/// Zero-sized user data (`()`, the common case) is not stored by id at all: all values of a
/// zero-sized type are alike. If the type has drop glue they are kept on a stack that never
/// allocates, `free` hands back any one of them, and the number kept always equals the
/// number of live allocations (so each value is still dropped exactly once). This spares
/// `allocate` and `free` a store and a load in a table as long as the node arena, which was
/// a cache miss on about half of the frees in the VMA benchmark replica. Without drop glue
/// (`()`) they are not kept at all: `allocate` forgets the value and `free` makes one, which
/// spares the stack's length, a read-modify-write in every allocation and free (about 7
/// instructions per operation and 2% of the replica's time, docs/performance.md, seventh
/// round).
#[derive(Debug)]
struct Users<U> {
    /// Sized `U`: `Some` exactly for live ids.
    by_id: Vec<Option<U>>,
    /// Zero-sized `U`: one value per live allocation.
    zst: Vec<U>,
}

impl<U> Default for Users<U> {
    fn default() -> Self {
        Users {
            by_id: Vec::new(),
            zst: Vec::new(),
        }
    }
}

impl<U> Users<U> {
    const ZST: bool = std::mem::size_of::<U>() == 0;
    /// Zero-sized and without drop glue: not kept at all.
    const UNKEPT: bool = Self::ZST && !std::mem::needs_drop::<U>();

    /// A value of a zero-sized `U` without drop glue, given back for one that
    /// [`put`](Self::put) forgot, or a reference to one.
    ///
    /// # Safety
    ///
    /// [`Self::UNKEPT`], and a value of `U` was given to `put` for a live allocation (so `U`
    /// is inhabited).
    #[inline(always)]
    unsafe fn unkept() -> U {
        debug_assert!(Self::UNKEPT);
        // SAFETY: `U` is zero-sized, so a dangling, aligned, non-null pointer is valid for
        // reading one (its zero bytes), and it is inhabited (the caller's `put` had a value),
        // so the empty bit pattern read is that value. It stands for the value `put` forgot
        // for this allocation, one for one, so no more values come out than went in; `U` has
        // no drop glue, so forgetting one and making another is the same as keeping it.
        unsafe { std::ptr::NonNull::<U>::dangling().as_ptr().read() }
    }

    #[inline(always)]
    fn put(&mut self, id: u32, user: U) {
        if Self::UNKEPT {
            // Made again by `take` (see `unkept`).
            std::mem::forget(user);
        } else if Self::ZST {
            self.zst.push(user);
        } else if let Some(u) = self.by_id.get_mut(id as usize) {
            *u = Some(user);
        } else {
            self.grow(id, user);
        }
    }

    #[cold]
    fn grow(&mut self, id: u32, user: U) {
        // Ids are dense (arena indices), so the vector grows by one at a time, amortised.
        self.by_id.resize_with(id as usize, || None);
        self.by_id.push(Some(user));
    }

    /// Takes the data of live allocation `id` (the caller has checked that it is live).
    #[inline(always)]
    fn take(&mut self, id: u32) -> Option<U> {
        if Self::UNKEPT {
            // SAFETY: UNKEPT, and the caller has checked that `id` is live, so `put` had a
            // value for it.
            Some(unsafe { Self::unkept() })
        } else if Self::ZST {
            self.zst.pop()
        } else {
            self.by_id.get_mut(id as usize).and_then(Option::take)
        }
    }

    fn get(&self, id: u32) -> Option<&U> {
        if Self::UNKEPT {
            // SAFETY: `U` is zero-sized: a dangling, aligned, non-null pointer is valid for
            // reads of its zero bytes, for any lifetime. The caller has checked that `id` is
            // live, so `put` had a value for it and `U` is inhabited.
            Some(unsafe { std::ptr::NonNull::<U>::dangling().as_ref() })
        } else if Self::ZST {
            self.zst.first()
        } else {
            self.by_id.get(id as usize).and_then(Option::as_ref)
        }
    }

    fn get_mut(&mut self, id: u32) -> Option<&mut U> {
        if Self::UNKEPT {
            // SAFETY: as in `get`; a zero-sized access aliases nothing, so the unique
            // reference does not overlap any other.
            Some(unsafe { std::ptr::NonNull::<U>::dangling().as_mut() })
        } else if Self::ZST {
            self.zst.first_mut()
        } else {
            self.by_id.get_mut(id as usize).and_then(Option::as_mut)
        }
    }

    /// How many values are kept (`None`: not kept, [`Self::UNKEPT`]).
    fn len(&self) -> Option<usize> {
        if Self::UNKEPT {
            None
        } else if Self::ZST {
            Some(self.zst.len())
        } else {
            Some(self.by_id.iter().filter(|u| u.is_some()).count())
        }
    }

    fn clear(&mut self) {
        self.by_id.clear();
        self.zst.clear();
    }
}

/// Why `allocate_core` or `free_core` failed: a small code that fits in a register, turned
/// into an [`Error`] (with its details) by the inlined public wrappers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Fail {
    ZeroSize,
    BadAlignment,
    TooManyTags,
    UpperAddressNotLinear,
    UpperAddressInRing,
    TooManyAllocations,
    OutOfSpace,
    StaleHandle,
    ForeignHandle,
}

/// What the algorithm records for a live allocation (user data aside).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Record {
    pub offset: u64,
    pub size: u64,
    /// [`Meta`] bits.
    pub meta: u32,
    pub generation: u32,
}

/// An allocation's alignment, tag and whether it is named, packed into 23 bits so that the
/// TLSF node of a used range can carry them (see `tlsf::TAKEN`): bits 0..6 log2(alignment)
/// (where the TLSF finds it to locate an allocation after its padding, `tlsf::ALIGN_BITS`),
/// bit 6 named, bits 7..23 the tag code (index + 1 into `VirtualBlock::tags`, 0 untagged).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Meta(u32);

impl Meta {
    const NAMED: u32 = 1 << 6;
    const TAG_SHIFT: u32 = 7;

    #[inline]
    fn new(align: u64, named: bool, tag: u16) -> Self {
        Meta(align.trailing_zeros() | u32::from(named) << 6 | u32::from(tag) << Self::TAG_SHIFT)
    }
    fn align(self) -> u64 {
        1 << (self.0 & 63)
    }
    #[inline]
    fn named(self) -> bool {
        self.0 & Self::NAMED != 0
    }
    fn tag(self) -> u16 {
        (self.0 >> Self::TAG_SHIFT) as u16
    }
    fn with_named(self, named: bool) -> Self {
        Meta(self.0 & !Self::NAMED | u32::from(named) << 6)
    }
    fn with_tag(self, tag: u16) -> Self {
        Meta(self.0 & !(0xffff << Self::TAG_SHIFT) | u32::from(tag) << Self::TAG_SHIFT)
    }
}

// The 16-bit tag code ends at bit 23, inside what a used TLSF node can carry, and the
// alignment's log2 is where the TLSF reads it.
const _: () = assert!((1u32 << (Meta::TAG_SHIFT + 16)) - 1 <= tlsf::META_MASK);
const _: () = assert!(Meta::NAMED == tlsf::ALIGN_BITS + 1);

/// [`VirtualBlock::allocate_core`] with the general TLSF search ([`Tlsf::find`]).
const GENERAL_CORE: u8 = 0;
/// [`VirtualBlock::allocate_core`] of a [`Strategy::Balanced`] request with alignment 1
/// ([`Tlsf::find_balanced_unaligned`]).
const BALANCED_UNALIGNED_CORE: u8 = 1;
/// [`VirtualBlock::allocate_core`] of a [`Strategy::Balanced`] request whose size minus one
/// is below [`BOUNDED_SIZE`] ([`Tlsf::find_balanced_bounded`]).
const BALANCED_BOUNDED_CORE: u8 = 2;
/// Sizes in `1..=BOUNDED_SIZE` (2^63) may take [`Tlsf::find_balanced_bounded`]: a size plus
/// an alignment mask (below 2^63) stays below 2^64.
const BOUNDED_SIZE: u64 = 1 << 63;

#[derive(Clone, Debug)]
enum Engine {
    Tlsf(Tlsf),
    Linear(Linear),
}

impl Engine {
    /// The live allocation `id` (any generation), if there is one.
    #[inline(always)]
    fn record(&self, id: u32) -> Option<Record> {
        match self {
            Engine::Tlsf(t) => t.record(id),
            Engine::Linear(l) => l.record(id),
        }
    }

    fn set_meta(&mut self, id: u32, meta: Meta) {
        match self {
            Engine::Tlsf(t) => t.set_meta(id, meta.0),
            Engine::Linear(l) => l.set_meta(id, meta.0),
        }
    }
}

/// The record of `a` if it is a live allocation of `engine`, or why it is not one.
#[inline(always)]
fn check_handle(engine: &Engine, stamps: &Stamps, a: Alloc) -> Result<Record, Error> {
    // The offset check guards against a wrapped stamp counter landing on the same record.
    match engine.record(a.id) {
        Some(r) if r.generation == a.stamp.get() && r.offset == a.offset => Ok(r),
        _ => Err(stamps.why_not_live(a.stamp)),
    }
}

/// The stamps a block gives its allocations (see [`Alloc`]): odd numbers, counted in steps
/// of 2 from a point of the 32-bit circle unique to the block, so never 0.
#[derive(Clone, Copy, Debug)]
struct Stamps {
    /// The first stamp.
    base: u32,
    /// The next stamp (odd).
    next: u32,
    /// Stamps issued so far.
    issued: u64,
}

impl Stamps {
    fn new(block: NonZeroU32) -> Self {
        // An odd multiplier is a bijection of u32; 2³²/φ spreads consecutive block numbers
        // around the circle.
        let base = block.get().wrapping_mul(0x9e37_79b9) | 1;
        Stamps {
            base,
            next: base,
            issued: 0,
        }
    }

    /// The stamp the next allocation gets.
    #[inline(always)]
    fn peek(&self) -> NonZeroU32 {
        // Odd, so `| 1` changes nothing; it only tells the compiler that it is not 0.
        nonzero_stamp(self.next)
    }

    /// Takes the next stamp.
    #[inline(always)]
    fn take(&mut self) -> NonZeroU32 {
        let stamp = self.peek();
        self.next = self.next.wrapping_add(2);
        self.issued += 1;
        stamp
    }

    /// Why a handle with `stamp` is not a live allocation: stale if this block issued the
    /// stamp, foreign if it never did.
    #[cold]
    fn why_not_live(&self, stamp: NonZeroU32) -> Error {
        let steps = stamp.get().wrapping_sub(self.base);
        if steps % 2 == 0 && u64::from(steps / 2) < self.issued {
            Error::StaleHandle
        } else {
            Error::ForeignHandle
        }
    }
}

/// A stamp (odd) as the non-zero number it is.
#[inline(always)]
fn nonzero_stamp(stamp: u32) -> NonZeroU32 {
    NonZeroU32::new(stamp | 1).unwrap_or(NonZeroU32::MIN)
}

/// Source of block identities for foreign-handle detection.
static NEXT_BLOCK_ID: AtomicU32 = AtomicU32::new(1);

fn next_block_id() -> NonZeroU32 {
    loop {
        if let Some(id) = NonZeroU32::new(NEXT_BLOCK_ID.fetch_add(1, Ordering::Relaxed)) {
            return id;
        }
    }
}

/// Offsets in a block of memory the allocator never touches; see the [module](self) docs.
///
/// `U` is per-allocation user data, returned by [`free`](Self::free).
#[derive(Debug)]
pub struct VirtualBlock<U = ()> {
    id: NonZeroU32,
    capacity: u64,
    engine: Engine,
    /// User data by allocation id. Everything else about an allocation lives in its TLSF
    /// node or linear slot.
    users: Users<U>,
    /// The next allocation's stamp. One counter for the block rather than one per id: an
    /// id's stamp need not survive while the id is free (a TLSF node is then part of a free
    /// range), and a stale handle matches only if the same id gets the same 32-bit stamp at
    /// the same offset.
    stamps: Stamps,
    /// Live user allocations and their requested bytes.
    live_count: u32,
    live_bytes: u64,
    defrag: defrag::DefragState,
    name: Option<Box<str>>,
    /// Distinct tags in use, so that an allocation stores a 2-byte index.
    tags: Vec<Tag>,
    /// Names of the allocations that have one, by id (names are rare and cold).
    names: HashMap<u32, Box<str>>,
}

impl<U> VirtualBlock<U> {
    /// A TLSF block of `capacity` units.
    pub fn new(capacity: u64) -> Self {
        Self::with_algorithm(capacity, Algorithm::Tlsf)
    }

    /// A linear block of `capacity` units.
    ///
    /// ```
    /// use tagalloc::virtual_block::{Request, VirtualBlock};
    /// let mut frame = VirtualBlock::<()>::new_linear(1024);
    /// let low = frame.allocate(&Request::new(100), ())?;
    /// let high = frame.allocate(&Request::new(100).upper_address(), ())?;
    /// assert_eq!((low.offset(), high.offset()), (0, 924));
    /// # Ok::<(), tagalloc::virtual_block::Error>(())
    /// ```
    pub fn new_linear(capacity: u64) -> Self {
        Self::with_algorithm(capacity, Algorithm::Linear)
    }

    /// A block of `capacity` units using `algorithm`.
    pub fn with_algorithm(capacity: u64, algorithm: Algorithm) -> Self {
        let engine = match algorithm {
            Algorithm::Tlsf => Engine::Tlsf(Tlsf::new(capacity)),
            Algorithm::Linear => Engine::Linear(Linear::new(capacity)),
        };
        let id = next_block_id();
        VirtualBlock {
            id,
            capacity,
            engine,
            users: Users::default(),
            stamps: Stamps::new(id),
            live_count: 0,
            live_bytes: 0,
            defrag: defrag::DefragState::default(),
            name: None,
            tags: Vec::new(),
            names: HashMap::new(),
        }
    }

    /// Names the block (shown by the SVG map and the example's reports).
    pub fn set_name(&mut self, name: &str) {
        self.name = Some(name.into());
    }

    /// The block's name, if set.
    pub fn name(&self) -> Option<&str> {
        self.name.as_deref()
    }

    /// The block's size.
    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// The block's algorithm.
    pub fn algorithm(&self) -> Algorithm {
        match self.engine {
            Engine::Tlsf(_) => Algorithm::Tlsf,
            Engine::Linear(_) => Algorithm::Linear,
        }
    }

    /// The number of live allocations.
    pub fn len(&self) -> usize {
        self.live_count as usize
    }

    /// True when nothing is allocated (pending defragmentation reservations included).
    pub fn is_empty(&self) -> bool {
        self.live_count == 0 && self.defrag.open == 0
    }

    /// Allocates `req.size()` units; `user` is stored with the allocation.
    ///
    /// TLSF: O(1) unless the good-fit lists are empty, and it fails only when no free range
    /// can hold the request after alignment.
    #[inline]
    pub fn allocate(&mut self, req: &Request<'_>, user: U) -> Result<Alloc, Error> {
        // A thin wrapper, inlined into the caller, around a core that returns two registers:
        // the handle is then built where it is used instead of being passed back through
        // memory (a 40-byte `Result` written field by field and read back with wider loads,
        // which the CPU cannot forward from its store buffer).
        // Requests without tag and name (decided at compile time for most call sites) pass
        // their fields in registers, and the request itself need not be built in memory.
        let (offset, key) = if req.tag.is_none() && req.name.is_none() {
            // The default strategy has a core of its own, where the strategy is a constant:
            // no jump table on it on every allocation.
            if req.strategy == Strategy::Balanced {
                // Alignment 1 (0 means 1) has a core of its own too: no padding to handle.
                if req.align <= 1 {
                    self.allocate_balanced_unaligned(req.size, req.upper, user)
                } else {
                    self.allocate_balanced(req.size, req.align, req.upper, user)
                }
            } else {
                self.allocate_plain(req.size, req.align, req.strategy, req.upper, user)
            }
        } else {
            self.allocate_labelled(req, user)
        };
        if key as u32 != NIL {
            Ok(Alloc {
                offset,
                id: key as u32,
                stamp: nonzero_stamp((key >> 32) as u32),
            })
        } else {
            Err(self.failure(offset, req))
        }
    }

    /// [`allocate`](Self::allocate) of a request without tag or name.
    #[inline(never)]
    fn allocate_plain(
        &mut self,
        size: u64,
        align: u64,
        strategy: Strategy,
        upper: bool,
        user: U,
    ) -> (u64, u64) {
        let req = Request::unlabelled(size, align, strategy, upper);
        self.allocate_core::<GENERAL_CORE>(&req, user)
    }

    /// [`allocate_plain`](Self::allocate_plain) with [`Strategy::Balanced`].
    #[inline(never)]
    fn allocate_balanced(&mut self, size: u64, align: u64, upper: bool, user: U) -> (u64, u64) {
        // Sizes 0 and above 2^63 (which no sane block holds) and alignments that are not
        // powers of two (all refused there) go to the general core; the rest take a search
        // whose sums cannot overflow (`Tlsf::find_balanced_bounded`), and the core's own
        // tests of the size and the alignment fold away.
        if size.wrapping_sub(1) >= BOUNDED_SIZE || !align.is_power_of_two() {
            return self.allocate_plain(size, align, Strategy::Balanced, upper, user);
        }
        let req = Request::unlabelled(size, align, Strategy::Balanced, upper);
        self.allocate_core::<BALANCED_BOUNDED_CORE>(&req, user)
    }

    /// [`allocate_balanced`](Self::allocate_balanced) with alignment 1: the compiler drops
    /// what only padding needs.
    #[inline(never)]
    fn allocate_balanced_unaligned(&mut self, size: u64, upper: bool, user: U) -> (u64, u64) {
        let req = Request::unlabelled(size, 1, Strategy::Balanced, upper);
        self.allocate_core::<BALANCED_UNALIGNED_CORE>(&req, user)
    }

    /// [`allocate`](Self::allocate) of a request with a tag or a name.
    #[inline(never)]
    fn allocate_labelled(&mut self, req: &Request<'_>, user: U) -> (u64, u64) {
        self.allocate_core::<GENERAL_CORE>(req, user)
    }

    /// [`allocate`](Self::allocate) without the handle: `(offset, stamp << 32 | id)` on
    /// success, `(Fail as u64, NIL)` on failure (`NIL` is never an id).
    ///
    /// `CORE` picks the TLSF search: [`GENERAL_CORE`] any request;
    /// [`BALANCED_UNALIGNED_CORE`] a request known to have alignment 1 and strategy
    /// [`Strategy::Balanced`] ([`allocate_balanced_unaligned`](Self::allocate_balanced_unaligned));
    /// [`BALANCED_BOUNDED_CORE`] one known to have strategy [`Strategy::Balanced`] and a
    /// size in `1..=2^63` ([`allocate_balanced`](Self::allocate_balanced)).
    #[inline(always)]
    fn allocate_core<const CORE: u8>(&mut self, req: &Request<'_>, user: U) -> (u64, u64) {
        let fail = |f: Fail| (f as u64, u64::from(NIL));
        if req.size == 0 {
            return fail(Fail::ZeroSize);
        }
        // 0 means 1, as in VMA.
        let align = req.align.max(1);
        if !align.is_power_of_two() {
            return fail(Fail::BadAlignment);
        }
        let Ok(tag) = self.tag_code(req.tag) else {
            return fail(Fail::TooManyTags);
        };
        let meta = Meta::new(align, req.name.is_some(), tag);
        let generation = self.stamps.peek().get();
        let (id, offset) = match &mut self.engine {
            Engine::Tlsf(t) => {
                if req.upper {
                    return fail(Fail::UpperAddressNotLinear);
                }
                if !t.has_room() {
                    return fail(Fail::TooManyAllocations);
                }
                let found = match CORE {
                    BALANCED_UNALIGNED_CORE => {
                        debug_assert!(align == 1 && req.strategy == Strategy::Balanced);
                        t.find_balanced_unaligned(req.size)
                    }
                    BALANCED_BOUNDED_CORE => {
                        debug_assert!(req.strategy == Strategy::Balanced);
                        // The search gives the padding; `take` finds it again from the
                        // offset with the same load, and the sum and difference fold away.
                        t.find_balanced_bounded(req.size, align)
                            .map(|(i, li, pad)| (i, li, t.free_offset(i) + pad))
                    }
                    _ => t.find(req.size, align, req.strategy),
                };
                match found {
                    Some((i, li, at)) => {
                        let kind = NodeKind::Used {
                            meta: meta.0,
                            generation,
                        };
                        (t.take(i, li, at, req.size, kind), at)
                    }
                    None => return fail(Fail::OutOfSpace),
                }
            }
            Engine::Linear(l) => match l.allocate(req.size, align, req.upper, meta.0, generation) {
                Ok(placed) => placed,
                Err(LinearFail::UpperInRing) => return fail(Fail::UpperAddressInRing),
                Err(LinearFail::TooManyAllocations) => return fail(Fail::TooManyAllocations),
                Err(LinearFail::NoSpace) => return fail(Fail::OutOfSpace),
            },
        };
        self.stamps.take();
        self.put_user(id, user);
        if let Some(name) = req.name {
            self.names.insert(id, name.into());
        }
        self.live_count += 1;
        self.live_bytes += req.size;
        (offset, u64::from(generation) << 32 | u64::from(id))
    }

    /// The error for a [`Fail`] code of `allocate_core` (given as its `u64`).
    #[cold]
    fn failure(&self, code: u64, req: &Request<'_>) -> Error {
        match code {
            c if c == Fail::ZeroSize as u64 => Error::ZeroSize,
            c if c == Fail::BadAlignment as u64 => Error::BadAlignment(req.align),
            c if c == Fail::TooManyTags as u64 => Error::TooManyTags,
            c if c == Fail::UpperAddressNotLinear as u64 => Error::UpperAddressNotLinear,
            c if c == Fail::UpperAddressInRing as u64 => Error::UpperAddressInRing,
            c if c == Fail::TooManyAllocations as u64 => Error::TooManyAllocations,
            _ => self.out_of_space(req),
        }
    }

    /// Stores the user data of new allocation `id`.
    #[inline(always)]
    fn put_user(&mut self, id: u32, user: U) {
        self.users.put(id, user);
    }

    /// The code of a tag, adding it to the block's table when new. The table grows (through
    /// the global allocator) only the first time the block sees a tag; after that a tagged
    /// allocation finds its code without allocating.
    #[inline]
    fn tag_code(&mut self, tag: Option<Tag>) -> Result<u16, Error> {
        let Some(tag) = tag else { return Ok(0) };
        if let Some(i) = self.tags.iter().position(|&t| t.same(tag)) {
            return Ok(i as u16 + 1);
        }
        if self.tags.len() >= usize::from(u16::MAX) {
            return Err(Error::TooManyTags);
        }
        self.tags.push(tag);
        Ok(self.tags.len() as u16)
    }

    /// The tag of a code.
    fn tag_of(&self, code: u16) -> Option<Tag> {
        code.checked_sub(1).map(|i| self.tags[usize::from(i)])
    }

    #[cold]
    fn out_of_space(&self, req: &Request<'_>) -> Error {
        Error::OutOfSpace {
            size: req.size,
            align: req.align.max(1),
            free_bytes: self.free_bytes(),
            largest_free_at_least: match &self.engine {
                Engine::Tlsf(t) => t.largest_free_at_least(),
                Engine::Linear(l) => l.largest_usable(),
            },
        }
    }

    /// The record of a live handle, or why it is not one.
    #[inline(always)]
    fn check(&self, a: Alloc) -> Result<Record, Error> {
        check_handle(&self.engine, &self.stamps, a)
    }

    /// Frees an allocation and returns its user data. O(1) with TLSF (merging with free
    /// neighbours), O(log n) at worst with the linear algorithm.
    #[inline]
    pub fn free(&mut self, a: Alloc) -> Result<U, Error> {
        // Inlined wrapper, like `allocate`'s: the handle goes in registers and a failure
        // comes back as a one-byte code rather than a 40-byte `Error` through memory.
        self.free_core(a.offset, a.id, a.stamp)
            .map_err(|f| match f {
                Fail::ForeignHandle => Error::ForeignHandle,
                _ => Error::StaleHandle,
            })
    }

    #[inline(never)]
    fn free_core(&mut self, offset: u64, id: u32, stamp: NonZeroU32) -> Result<U, Fail> {
        let live = |r: Option<Record>| match r {
            Some(r) if r.generation == stamp.get() && r.offset == offset => Ok(r),
            _ => match self.stamps.why_not_live(stamp) {
                Error::ForeignHandle => Err(Fail::ForeignHandle),
                _ => Err(Fail::StaleHandle),
            },
        };
        // One match on the algorithm for the check and the release. A live record always has
        // its user data; taking it before touching the algorithm keeps the block unchanged
        // should that ever not hold.
        let (r, user) = match &mut self.engine {
            Engine::Tlsf(t) => {
                let r = live(t.record(id))?;
                let user = self.users.take(id).ok_or(Fail::StaleHandle)?;
                t.release_from(id, r.offset);
                (r, user)
            }
            Engine::Linear(l) => {
                let r = live(l.record(id))?;
                let user = self.users.take(id).ok_or(Fail::StaleHandle)?;
                let freed = l.free(id);
                debug_assert_eq!(freed, Some(r));
                (r, user)
            }
        };
        if Meta(r.meta).named() {
            self.names.remove(&id);
        }
        self.live_count -= 1;
        self.live_bytes -= r.size;
        Ok(user)
    }

    /// Frees everything at once (dropping the user data); every handle becomes stale, and
    /// pending defragmentation moves are forgotten.
    pub fn clear(&mut self) {
        // Old handles stay stale: the stamp counter carries on, so no new allocation
        // repeats theirs (and ids beyond the emptied arena are simply not live).
        self.users.clear();
        match &mut self.engine {
            Engine::Tlsf(t) => t.clear(),
            Engine::Linear(l) => l.clear(),
        }
        self.names.clear();
        self.live_count = 0;
        self.live_bytes = 0;
        self.defrag.forget();
    }

    /// Extends the block to `new_capacity` units; existing allocations stay where they are.
    ///
    /// With TLSF the new space joins a free range at the end. With the linear algorithm the
    /// lower part can grow into it at once; an upper stack keeps its offsets, so the new space
    /// above it is reached once that stack is empty.
    ///
    /// ```
    /// use tagalloc::virtual_block::{Request, VirtualBlock};
    /// let mut b = VirtualBlock::<()>::new(100);
    /// assert!(b.allocate(&Request::new(150), ()).is_err());
    /// b.grow(200)?;
    /// assert!(b.allocate(&Request::new(150), ()).is_ok());
    /// # Ok::<(), tagalloc::virtual_block::Error>(())
    /// ```
    pub fn grow(&mut self, new_capacity: u64) -> Result<(), Error> {
        if new_capacity < self.capacity {
            return Err(Error::CannotShrink {
                capacity: self.capacity,
                requested: new_capacity,
            });
        }
        match &mut self.engine {
            Engine::Tlsf(t) => t.grow(new_capacity),
            Engine::Linear(l) => l.grow(new_capacity),
        }
        self.capacity = new_capacity;
        Ok(())
    }

    /// Everything about a live allocation.
    pub fn info(&self, a: Alloc) -> Result<AllocInfo<'_, U>, Error> {
        let r = self.check(a)?;
        self.info_of(a.id, r).ok_or(Error::StaleHandle)
    }

    fn info_of(&self, id: u32, r: Record) -> Option<AllocInfo<'_, U>> {
        let meta = Meta(r.meta);
        Some(AllocInfo {
            handle: Alloc {
                offset: r.offset,
                id,
                stamp: NonZeroU32::new(r.generation)?,
            },
            offset: r.offset,
            size: r.size,
            align: meta.align(),
            tag: self.tag_of(meta.tag()),
            name: if meta.named() {
                self.names.get(&id).map(|n| &**n)
            } else {
                None
            },
            user: self.users.get(id)?,
        })
    }

    /// True when `a` is a live allocation of this block.
    pub fn contains(&self, a: Alloc) -> bool {
        self.check(a).is_ok()
    }

    /// The user data of a live allocation.
    pub fn user_data(&self, a: Alloc) -> Result<&U, Error> {
        self.check(a)?;
        self.users.get(a.id).ok_or(Error::StaleHandle)
    }

    /// The user data of a live allocation, to change it.
    pub fn user_data_mut(&mut self, a: Alloc) -> Result<&mut U, Error> {
        self.check(a)?;
        self.users.get_mut(a.id).ok_or(Error::StaleHandle)
    }

    /// Renames an allocation (`None` removes the name).
    pub fn set_allocation_name(&mut self, a: Alloc, name: Option<&str>) -> Result<(), Error> {
        let r = self.check(a)?;
        self.engine
            .set_meta(a.id, Meta(r.meta).with_named(name.is_some()));
        match name {
            Some(n) => self.names.insert(a.id, n.into()),
            None => self.names.remove(&a.id),
        };
        Ok(())
    }

    /// Re-tags an allocation.
    pub fn set_tag(&mut self, a: Alloc, tag: Option<Tag>) -> Result<(), Error> {
        let r = self.check(a)?;
        let code = self.tag_code(tag)?;
        self.engine.set_meta(a.id, Meta(r.meta).with_tag(code));
        Ok(())
    }

    /// Every taken range in offset order: `(offset, size, owner)`.
    fn taken(&self) -> Box<dyn Iterator<Item = (u64, u64, Owner)> + '_> {
        match &self.engine {
            Engine::Tlsf(t) => Box::new(t.taken().map(|(i, o, s, k)| {
                let owner = match k {
                    NodeKind::Used { meta, generation } => Owner::Alloc(
                        i,
                        Record {
                            offset: o,
                            size: s,
                            meta,
                            generation,
                        },
                    ),
                    NodeKind::Reserved(_) | NodeKind::Free | NodeKind::Vacant => Owner::Reserved,
                };
                (o, s, owner)
            })),
            Engine::Linear(l) => Box::new(l.taken().map(|(o, s, id)| {
                let owner = match l.record(id) {
                    Some(r) => Owner::Alloc(id, r),
                    // Only reachable if the structures are corrupt; validate() reports it.
                    None => Owner::Reserved,
                };
                (o, s, owner)
            })),
        }
    }

    /// Every range of the block in offset order: allocations, reserved and free space.
    ///
    /// ```
    /// use tagalloc::virtual_block::{Range, Request, VirtualBlock};
    /// let mut b = VirtualBlock::<()>::new(100);
    /// b.allocate(&Request::new(10).align(16), ())?;
    /// let sizes: Vec<_> = b.ranges().map(|r| (r.offset(), r.size())).collect();
    /// assert_eq!(sizes, [(0, 10), (10, 90)]);
    /// assert!(matches!(b.ranges().last(), Some(Range::Free { .. })));
    /// # Ok::<(), tagalloc::virtual_block::Error>(())
    /// ```
    pub fn ranges(&self) -> Ranges<'_, U> {
        Ranges {
            block: self,
            taken: self.taken(),
            cursor: 0,
            held: None,
        }
    }

    /// Checks every internal invariant: the algorithm's structures, the handle table, and
    /// that counters equal recomputed sums. Meant for tests and debugging (O(n)).
    pub fn validate(&self) -> Result<(), ValidationError> {
        self.validate_inner().map_err(ValidationError)
    }

    fn validate_inner(&self) -> Result<(), String> {
        match &self.engine {
            Engine::Tlsf(t) => t.validate()?,
            Engine::Linear(l) => l.validate()?,
        }
        let mut seen = std::collections::HashSet::new();
        let (mut count, mut bytes, mut reserved, mut reserved_bytes, mut free) = (0u32, 0, 0, 0, 0);
        let mut named = 0usize;
        let mut end = 0u64;
        for r in self.ranges() {
            if r.offset() != end || r.size() == 0 {
                return Err(format!("range at {} does not follow {end}", r.offset()));
            }
            end += r.size();
            match r {
                Range::Allocation(a) => {
                    let id = a.handle.id;
                    if !seen.insert(id) {
                        return Err(format!("allocation {id} listed twice"));
                    }
                    if a.offset % a.align != 0 {
                        return Err(format!(
                            "allocation at {} not aligned to {}",
                            a.offset, a.align
                        ));
                    }
                    let meta = self
                        .engine
                        .record(a.handle.id)
                        .map(|r| Meta(r.meta))
                        .ok_or_else(|| format!("allocation {id} has no record"))?;
                    if meta.named() != self.names.contains_key(&a.handle.id) {
                        return Err(format!(
                            "allocation {id}: name flag disagrees with the table"
                        ));
                    }
                    named += usize::from(meta.named());
                    if usize::from(meta.tag()) > self.tags.len() {
                        return Err(format!("allocation {id}: tag index out of the table"));
                    }
                    count += 1;
                    bytes += a.size;
                }
                Range::Reserved { size, .. } => {
                    reserved += 1;
                    reserved_bytes += size;
                }
                Range::Free { size, .. } => free += size,
            }
        }
        if end != self.capacity {
            return Err(format!("ranges end at {end}, block is {}", self.capacity));
        }
        if (count, bytes) != (self.live_count, self.live_bytes) {
            return Err(format!(
                "{count} allocations of {bytes} units listed, counters say {} of {}",
                self.live_count, self.live_bytes
            ));
        }
        if (reserved, reserved_bytes) != (self.defrag.open, self.defrag.reserved_bytes) {
            return Err("defragmentation reservations disagree with their counters".into());
        }
        if free != self.free_bytes() {
            return Err(format!(
                "{free} free units listed, counters say {}",
                self.free_bytes()
            ));
        }
        if let Engine::Tlsf(t) = &self.engine {
            self.defrag.validate(t)?;
        }
        // Listed allocations have user data (else `ranges` shows them reserved, which the
        // counters catch); nothing else may.
        if self.users.len().is_some_and(|kept| kept != count as usize) {
            return Err("user data kept for freed allocations".into());
        }
        if self.names.len() != named {
            return Err("names kept for freed allocations".into());
        }
        Ok(())
    }
}

/// What occupies a taken range.
#[derive(Clone, Copy, Debug)]
enum Owner {
    /// A live allocation: its id and record.
    Alloc(u32, Record),
    Reserved,
}

/// Iterator over a block's ranges, see [`VirtualBlock::ranges`].
pub struct Ranges<'a, U> {
    block: &'a VirtualBlock<U>,
    taken: Box<dyn Iterator<Item = (u64, u64, Owner)> + 'a>,
    cursor: u64,
    held: Option<(u64, u64, Owner)>,
}

impl<'a, U> Iterator for Ranges<'a, U> {
    type Item = Range<'a, U>;

    fn next(&mut self) -> Option<Self::Item> {
        let next = self.held.take().or_else(|| self.taken.next());
        match next {
            Some((offset, size, owner)) => {
                if offset > self.cursor {
                    let free = Range::Free {
                        offset: self.cursor,
                        size: offset - self.cursor,
                    };
                    self.held = Some((offset, size, owner));
                    self.cursor = offset;
                    return Some(free);
                }
                self.cursor = offset + size;
                Some(match owner {
                    Owner::Reserved => Range::Reserved { offset, size },
                    Owner::Alloc(id, r) => match self.block.info_of(id, r) {
                        Some(info) => Range::Allocation(info),
                        // Only reachable if the structures are corrupt; validate() reports it.
                        None => Range::Reserved { offset, size },
                    },
                })
            }
            None if self.cursor < self.block.capacity => {
                let free = Range::Free {
                    offset: self.cursor,
                    size: self.block.capacity - self.cursor,
                };
                self.cursor = self.block.capacity;
                Some(free)
            }
            None => None,
        }
    }
}

/// A broken invariant found by [`VirtualBlock::validate`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ValidationError(String);

impl fmt::Display for ValidationError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "virtual block is inconsistent: {}", self.0)
    }
}

impl std::error::Error for ValidationError {}
