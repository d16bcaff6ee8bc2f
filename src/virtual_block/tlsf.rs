//! The good-fit algorithm: two-level segregated fit (TLSF) over offsets.
//!
//! Every region of the block, free or taken, is a [`Node`] in one arena (`Vec`), linked to its
//! physical neighbours. Free nodes are also linked into one of many size-segregated lists. A
//! list is picked by a tiny floating-point encoding of the size: 5 bits of mantissa per power
//! of two (sizes below 32 get exact lists), so there are 32 lists per octave and a block in a
//! list is at most 1/32 (about 3 %) smaller than the next list's floor. Two bitmaps (one bit
//! per octave, one bit per list) find the first non-empty list at or above a size in a few
//! instructions.
//!
//! The fast path ("good fit") rounds the request up to the next list floor, so that *any*
//! block in the chosen list fits even after worst-case alignment padding: O(1), no list walk.
//! When that finds nothing, an exact search walks the lists that may still hold a fitting
//! block and checks each block's real offset. That second step is what makes the allocator
//! free of false out-of-memory failures (OffsetAllocator stops after the first step).
//!
//! Alignment padding (the free space an aligned allocation leaves before itself, smaller
//! than the alignment) is kept in the allocation's own node: a used node covers its padding
//! and its allocation, which starts at the node's first offset aligned to the allocation's
//! alignment (the low bits of its meta, see [`ALIGN_BITS`]). The padding is free space all
//! the same: the range before it takes it over when freed, it is freed with the allocation,
//! and the exact searches, which decide that nothing fits, first give every padding a free
//! node of its own in its list ([`Tlsf::list_all`]), so no false out-of-memory can come from
//! it. The O(1) paths do not see padding (it is too small for the requests that leave it).
//! That is a node and a list update less per aligned allocation, one node less to touch per
//! free, and an arena half the size when most allocations are padded (the numbers are in
//! docs/performance.md).
//!
//! Nothing here knows about handles or user data: a used node only carries the meta bits and
//! generation that the block above gives it, and a reserved one a move number.

use super::fit_summary::{FitSummaries, fit_at};
use super::{Record, Strategy};

/// "No node" in links.
pub(crate) const NIL: u32 = u32::MAX;

/// log2 of the number of lists per octave.
const SL_BITS: u32 = 5;
/// Lists per octave.
const SL_COUNT: usize = 1 << SL_BITS;
/// Size of the list-head table: 64 octaves' worth, although sizes below 2^64 reach only the
/// first 1920 lists, so that any list index masked with `LISTS - 1` is in bounds and the
/// compiler drops the bounds checks from the hot paths.
pub(crate) const LISTS: usize = 64 * SL_COUNT;

/// Most free blocks [`Strategy::MinMemory`] examines before settling.
pub(crate) const BEST_FIT_BUDGET: usize = 64;

/// What a node is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum NodeKind {
    /// A free range, linked into a size list.
    Free,
    /// A live allocation. The node index is the allocation's identity; `meta` is the block's
    /// packed per-allocation data (below 2^29) and `generation` tells this allocation from
    /// earlier ones that had the same node.
    Used { meta: u32, generation: u32 },
    /// The destination of a pending defragmentation move; the number is the move's index.
    Reserved(u32),
    /// Not part of the block: waiting in the arena for reuse.
    Vacant,
}

/// `prev_free` of a node that is not free holds a word with this bit set (node indices stay
/// below it, and NIL, the free "no previous node", is the only larger value with all bits
/// set). Bits 29 and 30 give the kind; bit 28 of a taken node says whether the node before it
/// is free ([`PREV_FREE`]); the 28 bits below carry an allocation's meta. The node's
/// `next_free` then holds the generation or the move index.
/// This keeps a node at 32 bytes, two per cache line, with everything `free` needs to check
/// a handle and release its range on one line.
const TAKEN: u32 = 1 << 31;
const VACANT: u32 = TAKEN;
const RESERVED: u32 = TAKEN | 1 << 29;
const USED: u32 = TAKEN | 2 << 29;
const KIND_MASK: u32 = TAKEN | 3 << 29;
/// In a taken node's word: the node before it (`prev_phys`) is a free node. A free node never
/// has a free neighbour, so only taken nodes need the bit; with it `release` loads the node
/// before only when it must merge with it (about half the time in the VMA replica), instead
/// of loading it to find out.
const PREV_FREE: u32 = 1 << 28;
/// The bits of a used node's word that hold its meta.
pub(crate) const META_MASK: u32 = PREV_FREE - 1;
/// The low bits of a used node's meta: log2 of the allocation's alignment. (The block's
/// `Meta` puts it there; a reserved node has 0 there, alignment 1, and never padding.)
pub(crate) const ALIGN_BITS: u32 = 63;
/// Nodes an arena may hold (indices below [`TAKEN`]).
pub(crate) const MAX_NODES: usize = TAKEN as usize;

#[derive(Clone, Debug)]
#[repr(align(32))]
struct Node {
    offset: u64,
    size: u64,
    prev_phys: u32,
    next_phys: u32,
    /// Free: the previous node of its list (or NIL). Otherwise a [`TAKEN`] word.
    prev_free: u32,
    /// Free: the next node of its list. Used: the generation. Reserved: the move index.
    next_free: u32,
}

impl Node {
    /// A vacant node (the arena's sink is one too).
    const VACANT: Node = Node {
        offset: 0,
        size: 0,
        prev_phys: NIL,
        next_phys: NIL,
        prev_free: VACANT,
        next_free: NIL,
    };

    #[inline]
    fn is_free(&self) -> bool {
        // Free links are below TAKEN or NIL; NIL + 1 wraps to 0.
        self.prev_free.wrapping_add(1) <= TAKEN
    }

    /// Where a taken node's allocation starts: its first offset aligned to the allocation's
    /// alignment (the node's own offset unless it holds padding).
    #[inline(always)]
    fn start(&self) -> u64 {
        debug_assert!(!self.is_free());
        let mask = (1u64 << (self.prev_free & ALIGN_BITS)) - 1;
        // Cannot wrap for a valid node: the aligned start lies inside it.
        self.offset.wrapping_add(mask) & !mask
    }

    /// The padding a taken node holds before its allocation (0 for a free or vacant node).
    #[inline(always)]
    fn padding(&self) -> u64 {
        if self.is_free() || self.prev_free & KIND_MASK == VACANT {
            0
        } else {
            self.start() - self.offset
        }
    }

    /// The padding a taken node holds ([`Node::padding`] without asking whether the node is
    /// taken).
    #[inline(always)]
    fn taken_padding(&self) -> u64 {
        debug_assert!(!self.is_free() && self.prev_free & KIND_MASK != VACANT);
        self.start() - self.offset
    }

    #[inline]
    fn kind(&self) -> NodeKind {
        if self.is_free() {
            return NodeKind::Free;
        }
        match self.prev_free & KIND_MASK {
            USED => NodeKind::Used {
                meta: self.prev_free & META_MASK,
                generation: self.next_free,
            },
            RESERVED => NodeKind::Reserved(self.next_free),
            _ => NodeKind::Vacant,
        }
    }

    /// Whether the node before this taken node is free ([`PREV_FREE`]).
    #[inline(always)]
    fn prev_is_free(&self) -> bool {
        debug_assert!(!self.is_free());
        self.prev_free & PREV_FREE != 0
    }

    /// Sets [`PREV_FREE`] of a taken node.
    #[inline(always)]
    fn set_prev_is_free(&mut self, on: bool) {
        debug_assert!(!self.is_free());
        self.prev_free = self.prev_free & !PREV_FREE | if on { PREV_FREE } else { 0 };
    }

    /// Marks a node taken by `kind` (`Used` or `Reserved`), with [`PREV_FREE`] clear.
    #[inline(always)]
    fn set_taken(&mut self, kind: NodeKind) {
        self.set_taken_words(taken_words(kind));
    }

    /// [`Node::set_taken`] with the words of [`taken_words`].
    #[inline(always)]
    fn set_taken_words(&mut self, (word, next): (u32, u32)) {
        (self.prev_free, self.next_free) = (word, next);
    }
}

/// The words a node taken by `kind` (`Used` or `Reserved`) holds in `prev_free` and
/// `next_free`, with [`PREV_FREE`] clear. (Two words in registers: [`Tlsf::take_tail`], out
/// of line, gets them so, where a `NodeKind` went through the stack on every allocation.)
#[inline(always)]
fn taken_words(kind: NodeKind) -> (u32, u32) {
    match kind {
        NodeKind::Used { meta, generation } => {
            debug_assert!(meta <= META_MASK);
            (USED | (meta & META_MASK), generation)
        }
        NodeKind::Reserved(m) => (RESERVED, m),
        NodeKind::Free | NodeKind::Vacant => unreachable!("not a taken kind"),
    }
}

/// The node arena: node `i` is `v[i + 1]`, and `v[0]` is the sink, where a list update
/// stores the link of a neighbour that is NIL (see [`Tlsf::link_slot`]); it is never read.
/// NIL, taken as an `i32`, is -1: the address of node NIL computed from node 0's by signed
/// offset is the sink's, so a link store needs no select between a node and the sink.
#[derive(Clone, Debug)]
struct Arena {
    v: Vec<Node>,
}

impl Arena {
    fn new() -> Self {
        Arena {
            v: vec![Node::VACANT],
        }
    }

    #[inline(always)]
    fn len(&self) -> usize {
        self.v.len() - 1
    }

    #[inline(always)]
    fn get(&self, i: usize) -> Option<&Node> {
        self.v.get(i.checked_add(1)?)
    }

    /// Forgets every node but keeps the sink (and the memory).
    fn clear(&mut self) {
        self.v.truncate(1);
    }

    /// Node `i`, unchecked.
    ///
    /// # Safety
    ///
    /// `i < self.len()`.
    #[inline(always)]
    unsafe fn get_unchecked(&self, i: usize) -> &Node {
        // SAFETY: the caller keeps `i` below `len()`, so `i + 1` is below `v.len()`.
        unsafe { self.v.get_unchecked(i + 1) }
    }

    /// Node `i`, unchecked, to change it.
    ///
    /// # Safety
    ///
    /// `i < self.len()`.
    #[inline(always)]
    unsafe fn get_unchecked_mut(&mut self, i: usize) -> &mut Node {
        // SAFETY: as in `get_unchecked`.
        unsafe { self.v.get_unchecked_mut(i + 1) }
    }

    /// The address of node `i`'s link field at byte offset `field`, by wrapping arithmetic
    /// from node 0 with `i` taken as an `i32`: inside the arena for `i < len()` (node indices
    /// stay below [`MAX_NODES`], 2^31, so they are not negative as `i32`s), the sink's field
    /// for `i == NIL`, and not to be used otherwise.
    #[inline(always)]
    fn link_field(&mut self, i: u32, field: usize) -> *mut u32 {
        self.v
            .as_mut_ptr()
            .wrapping_add(1)
            .wrapping_offset(i as i32 as isize)
            .cast::<u8>()
            .wrapping_add(field)
            .cast::<u32>()
    }
}

impl std::ops::Index<usize> for Arena {
    type Output = Node;
    #[inline(always)]
    fn index(&self, i: usize) -> &Node {
        &self.v[i + 1]
    }
}

impl std::ops::IndexMut<usize> for Arena {
    #[inline(always)]
    fn index_mut(&mut self, i: usize) -> &mut Node {
        &mut self.v[i + 1]
    }
}

/// The list a free block of `size` belongs in (rounding down), as one index `fl * 32 + sl`.
///
/// Branch-free: with `m` the top bit of `size | 32` and `s = m - 5`, the index is
/// `s * 32 + (size >> s)`. Sizes below 32 get `s = 0`, their own exact list; above, the top
/// six bits of the size (the leading one and five bits of mantissa) pick one of 32 lists in
/// octave `s + 1`.
#[inline(always)]
fn list_index(size: u64) -> usize {
    let s = (63 - (size | SL_COUNT as u64).leading_zeros()) - SL_BITS;
    ((s as usize) << SL_BITS) + (size >> s) as usize
}

/// The first list whose every block is at least `size` (rounding up): the size's own list if
/// `size` is that list's floor, else the next one. Never overflows; for sizes near 2^64 the
/// index lands in lists that stay empty.
#[inline(always)]
fn list_index_up(size: u64) -> usize {
    let s = (63 - (size | SL_COUNT as u64).leading_zeros()) - SL_BITS;
    let below_floor = size & ((1 << s) - 1);
    list_index(size) + usize::from(below_floor != 0)
}

/// The smallest size list `li` holds.
fn list_floor(li: usize) -> u64 {
    let (fl, sl) = (li / SL_COUNT, li % SL_COUNT);
    if fl == 0 {
        sl as u64
    } else {
        ((SL_COUNT + sl) as u64) << (fl - 1)
    }
}

/// The offset at which an allocation of `size` aligned to `align_mask + 1` lands in a free
/// block at `offset` of `block_size`, if it fits.
#[inline]
fn fit(offset: u64, block_size: u64, size: u64, align_mask: u64) -> Option<u64> {
    let aligned = offset.checked_add(align_mask)? & !align_mask;
    let used = (aligned - offset).checked_add(size)?;
    (used <= block_size).then_some(aligned)
}

/// Sums over the free ranges, recomputed by [`Tlsf::validate`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct FreeTotals {
    pub(crate) bytes: u64,
    pub(crate) count: u32,
    pub(crate) squares: u128,
}

impl FreeTotals {
    fn add(&mut self, size: u64) {
        self.bytes += size;
        self.count += 1;
        self.squares += u128::from(size) * u128::from(size);
    }
}

/// The free-list table.
#[derive(Clone, Debug)]
struct Lists {
    /// Heads of the free lists by list index (see [`list_index`]).
    heads: [u32; LISTS],
    /// Per octave, bit `sl` set when list `fl * 32 + sl` is non-empty.
    sl_bitmaps: [u32; 64],
}

/// A free range found for a request: its node, the node's list and the aligned offset.
pub(crate) type Found = (u32, usize, u64);

/// [`Found`] in two registers, for the searches kept out of line: `(node | list << 32, at)`,
/// with `at == u64::MAX` for none (an allocation of at least one unit never starts there).
/// An `Option<Found>` is returned through memory, and the fast path then went through memory
/// too, where the two paths meet.
type Packed = (u64, u64);

const NOT_FOUND: Packed = (0, u64::MAX);

#[inline(always)]
fn pack(found: Option<Found>) -> Packed {
    match found {
        Some((i, li, at)) => (u64::from(i) | (li as u64) << 32, at),
        None => NOT_FOUND,
    }
}

#[inline(always)]
fn unpack((node_list, at): Packed) -> Option<Found> {
    (at != u64::MAX).then_some((node_list as u32, (node_list >> 32) as usize, at))
}

/// The nodes below [`Tlsf::scan_from`](Tlsf) that hold padding (see the module docs), pushed
/// as they are made, at most once each (the nodes above are found by index). Entries go stale when the padding is taken over or the node freed: a node holds
/// padding exactly when [`Node::padding`] says so. Stale entries stay until the next
/// [`Tlsf::list_padding`] (or the block empties).
///
/// Invariant: `noted` has a flag for every node the arena has room for, and `entries` room for
/// one entry per flag ([`Tlsf::grow_arena`] keeps both in step with the arena's capacity). A
/// node is pushed only while its flag is clear, so the stack never holds more entries than
/// the arena has nodes, and pushing needs neither a capacity check nor a compaction.
#[derive(Debug)]
struct PaddedStack {
    entries: Vec<u32>,
    /// One byte per node, 1 when the node is on the stack. A node reused for another padded
    /// allocation while its old entry waits there is not pushed again (the entry names the
    /// node, not the allocation); in the GPU-heap workload the same few hundred nodes carry
    /// each frame's padded buffers. A byte rather than a bit: testing and setting it is a
    /// load, a compare and a store at the node's index, where a bit took nine instructions
    /// (word index, shifted mask, test) on every padded allocation; it costs 7/8 of a byte
    /// more per node the arena has room for (a node is 32 bytes).
    noted: Vec<u8>,
}

impl PaddedStack {
    /// Room for every node of `nodes` (the arena's capacity).
    fn fit(&mut self, nodes: usize) {
        if self.noted.len() < nodes {
            self.noted.resize(nodes, 0);
        }
        let room = self.noted.len();
        self.entries.reserve(room - self.entries.len());
    }

    /// Forgets every entry and clears their flags: O(min(entries, arena / 64)) (a fill of
    /// the flags is one wide store per 32 or 64 of them).
    fn clear(&mut self) {
        if self.entries.len() >= self.noted.len() / 64 {
            self.noted.fill(0);
        } else {
            for &i in &self.entries {
                self.noted[i as usize] = 0;
            }
        }
        self.entries.clear();
    }
}

impl Clone for PaddedStack {
    /// A clone keeps the invariant: room for an entry per flag (`Vec::clone` keeps only the
    /// length).
    fn clone(&self) -> Self {
        let mut entries = Vec::with_capacity(self.noted.len());
        entries.extend_from_slice(&self.entries);
        PaddedStack {
            entries,
            noted: self.noted.clone(),
        }
    }
}

/// The TLSF state of one block.
///
/// Invariant: every node index held in a link (`first`, `last`, a list head, a node's
/// physical or free-list neighbours) or on the vacant stack is below `nodes.len()`; `NIL`
/// stands for none. Nodes leave the arena only in [`Tlsf::clear`] and [`Tlsf::restart`],
/// which reset every link with them. The hot paths follow links without bounds checks
/// ([`Tlsf::node`]); [`Tlsf::validate`] checks the invariant with checked indexing, and an
/// index that comes from outside (a handle) is always checked ([`Tlsf::record`]).
#[derive(Clone, Debug)]
pub(crate) struct Tlsf {
    nodes: Arena,
    /// Nodes below `scan_from` that hold padding (see the module docs), pushed as they are
    /// made.
    padded: PaddedStack,
    /// Nodes from this index up are not pushed on the padded stack when they take padding:
    /// [`Tlsf::list_padding`] looks at each of them instead, and then moves this to the
    /// arena's end. Only the arena's end grows past it, and only [`Tlsf::clear`] and
    /// [`Tlsf::restart`] (which empty the arena) bring it down (to 0). So the nodes of a block
    /// filling from empty, and any node reused since, cost an allocation no flag test and no
    /// push; a listing looks at each node made since the last one once, which is what the
    /// pushes cost before (see docs/performance.md, seventh round).
    scan_from: u32,
    /// Set when a node takes padding, cleared by a listing: while it is clear, no node holds
    /// padding (a free only takes padding over), and [`Tlsf::list_all`] has nothing to do. A
    /// plain store per padded allocation, where a count of the padded nodes was a
    /// read-modify-write there and two in every free.
    maybe_padded: bool,
    /// Vacant nodes, most recently vacated last. A stack of indices rather than a chain
    /// through the nodes: taking one needs no load from the (possibly cold) node itself, so
    /// the two nodes an aligned allocation may create do not wait on each other.
    vacant: Vec<u32>,
    /// The node at offset 0 (NIL only for a zero-sized block).
    first: u32,
    /// The node that ends at the block's end.
    last: u32,
    capacity: u64,
    /// Bit `fl` set when octave `fl` has a non-empty list, or had one when a search last
    /// looked: an unlink that empties an octave leaves its bit alone, and the searches clear
    /// the bits of the empty octaves they meet ([`Tlsf::first_list_from`]).
    fl_bitmap: u64,
    /// List heads and per-list bitmaps, boxed together: one pointer away, and the block
    /// stays small.
    lists: Box<Lists>,
    /// What the exact search learnt about lists it walked, so that it can skip them.
    summaries: FitSummaries,
    /// Free ranges the searches have looked at (tests count the work of a search with it).
    #[cfg(test)]
    pub(crate) examined: u64,
}

impl Tlsf {
    pub(crate) fn new(capacity: u64) -> Self {
        let mut t = Tlsf {
            nodes: Arena::new(),
            padded: PaddedStack {
                entries: Vec::new(),
                noted: Vec::new(),
            },
            scan_from: 0,
            maybe_padded: false,
            vacant: Vec::new(),
            first: NIL,
            last: NIL,
            capacity: 0,
            fl_bitmap: 0,
            lists: Box::new(Lists {
                heads: [NIL; LISTS],
                sl_bitmaps: [0; 64],
            }),
            summaries: FitSummaries::new(),
            #[cfg(test)]
            examined: 0,
        };
        t.grow(capacity);
        t
    }

    /// Whether two more nodes (one allocation's padding and rest) fit in the arena.
    #[inline]
    pub(crate) fn has_room(&self) -> bool {
        self.nodes.len() + 2 < MAX_NODES
    }

    /// Node `i`, reached through a link.
    #[inline(always)]
    fn node(&self, i: u32) -> &Node {
        debug_assert!((i as usize) < self.nodes.len(), "link {i} out of the arena");
        // SAFETY: `i` comes from a link or the vacant stack, which the type's invariant keeps
        // below `nodes.len()`.
        unsafe { self.nodes.get_unchecked(i as usize) }
    }

    /// Node `i`, reached through a link, to change it.
    #[inline(always)]
    fn node_mut(&mut self, i: u32) -> &mut Node {
        debug_assert!((i as usize) < self.nodes.len(), "link {i} out of the arena");
        // SAFETY: as in `node`.
        unsafe { self.nodes.get_unchecked_mut(i as usize) }
    }

    /// A node to fill in: a vacant one, or a new one at the end of the arena.
    #[inline(always)]
    fn new_node(&mut self) -> u32 {
        match self.vacant.pop() {
            Some(i) => i,
            None => self.push_node(),
        }
    }

    /// A node at the end of the arena. Inline: a block filling up from empty takes every
    /// node here.
    #[inline(always)]
    fn push_node(&mut self) -> u32 {
        // The block refuses allocations before the arena reaches MAX_NODES.
        debug_assert!(self.nodes.len() < MAX_NODES);
        let i = self.nodes.len() as u32;
        let v = &mut self.nodes.v;
        if v.len() == v.capacity() {
            self.grow_arena();
        }
        let v = &mut self.nodes.v;
        let len = v.len();
        debug_assert!(len < v.capacity());
        // SAFETY: `grow_arena` left room for one more node when there was none, so `len` is
        // below the capacity; the node is written before the length covers it. (The same
        // check `Vec::push` makes, which would not keep `padded` in step.)
        unsafe {
            v.as_mut_ptr().add(len).write(Node::VACANT);
            v.set_len(len + 1);
        }
        i
    }

    /// Makes room for more nodes, and for them in the padded stack (out of line: the arena
    /// doubles).
    #[cold]
    #[inline(never)]
    fn grow_arena(&mut self) {
        self.nodes.v.reserve(1);
        // Node `i` is `v[i + 1]`: one slot less than the capacity.
        self.padded.fit(self.nodes.v.capacity() - 1);
    }

    /// Node `i` leaves the block (merged into a neighbour).
    #[inline(always)]
    fn recycle(&mut self, i: u32) {
        // A stale handle to it must not read as a live allocation.
        self.node_mut(i).prev_free = VACANT;
        self.vacant.push(i);
    }

    /// The free-list link field of node `i` (`next_free` if `next`, else `prev_free`), or the
    /// sink when `i` is NIL. List updates store a neighbour's link through it without testing
    /// whether there is a neighbour: those tests (is the list empty, is the node its head or
    /// tail) depend on the data and were among the most mispredicted branches of an
    /// allocation and a free.
    /// (The arena's sink takes the place of node NIL, see [`Arena`]: no select.)
    #[inline(always)]
    fn link_slot(&mut self, i: u32, next: bool) -> &mut u32 {
        debug_assert!(i == NIL || (i as usize) < self.nodes.len());
        let p = self.link_field(i, next);
        // SAFETY: `i` is NIL, and `p` is a link field of the arena's sink, `v[0]`; or `i`
        // comes from a link, which the type's invariant keeps below `nodes.len()`, and `p` is
        // that node's link field (`Arena::link_field`). Either way it is a valid, aligned
        // `u32` inside the arena, borrowed from `self` mutably for as long as the result
        // lives.
        unsafe { &mut *p }
    }

    /// The address of node `i`'s `next_free` (if `next`) or `prev_free`, or of the sink's
    /// for `i == NIL` ([`Arena::link_field`]).
    #[inline(always)]
    fn link_field(&mut self, i: u32, next: bool) -> *mut u32 {
        let field = if next {
            std::mem::offset_of!(Node, next_free)
        } else {
            std::mem::offset_of!(Node, prev_free)
        };
        self.nodes.link_field(i, field)
    }

    /// Links free node `i`, which is or will be `[offset, offset + size)`, at the head of
    /// list `li` (its size's list).
    #[inline(always)]
    fn link(&mut self, i: u32, li: usize, offset: u64, size: u64) {
        let li = li & (LISTS - 1);
        let (fl, bit) = (li / SL_COUNT, 1 << (li % SL_COUNT));
        let lists = &mut *self.lists;
        let head = std::mem::replace(&mut lists.heads[li], i);
        lists.sl_bitmaps[fl] |= bit;
        self.fl_bitmap |= 1 << fl;
        self.summaries.note(li, offset, size);
        let n = self.node_mut(i);
        n.prev_free = NIL;
        n.next_free = head;
        *self.link_slot(head, false) = i;
    }

    /// Unlinks free node `i` from list `li` (its size's list). Without branches: the
    /// neighbours' links go through [`Tlsf::link_slot`], the head and the list's bitmap are
    /// rewritten whether they change or not. The octave's bit stays set even if the octave
    /// is now empty (see [`Tlsf::fl_bitmap`](Tlsf)): clearing it without a branch took 5
    /// instructions per unlink, for octaves that rarely empty.
    #[inline(always)]
    fn unlink(&mut self, i: u32, li: usize) {
        let (prev, next) = {
            let n = self.node(i);
            debug_assert!(n.is_free() && list_index(n.size) == li);
            (n.prev_free, n.next_free)
        };
        let li = li & (LISTS - 1);
        // `next` goes to the list head if `i` is the head, else to the node before.
        let head: *mut u32 = &mut self.lists.heads[li];
        let before = self.link_field(prev, true);
        let to = if prev == NIL { head } else { before };
        // SAFETY: `to` is the list head, made from a live `&mut u32` into `self.lists`, or,
        // when `prev` is not NIL, the `next_free` field of node `prev`, a link the type's
        // invariant keeps below `nodes.len()`; nothing else is borrowed meanwhile.
        unsafe { *to = next };
        *self.link_slot(next, false) = prev;
        // The list is empty now if `i` was its only node: both links NIL (node indices stay
        // below 2^31, so only NIL & NIL is NIL).
        let empty = u32::from(prev & next == NIL);
        self.lists.sl_bitmaps[li / SL_COUNT] &= !(empty << (li % SL_COUNT));
    }

    /// Unlinks free node `i` from its list.
    #[inline(always)]
    fn unlink_free(&mut self, i: u32) {
        let size = self.node(i).size;
        self.unlink(i, list_index(size));
    }

    /// Links free node `i` into its list.
    fn link_free(&mut self, i: u32) {
        let (offset, size) = {
            let n = self.node(i);
            (n.offset, n.size)
        };
        self.link(i, list_index(size), offset, size);
    }

    /// Notes that node `i` now holds padding.
    #[inline(always)]
    fn add_padded(&mut self, i: u32) {
        debug_assert!((i as usize) < self.nodes.len());
        if !self.maybe_padded {
            self.maybe_padded = true;
        }
        if i >= self.scan_from {
            // `list_padding` looks at this node without a stack entry.
            return;
        }
        let stack = &mut self.padded;
        debug_assert!(
            (i as usize) < stack.noted.len(),
            "noted has no flag for node {i}"
        );
        // SAFETY: `noted` has a flag for every node the arena has room for (the invariant of
        // `PaddedStack`), and `i` is a node of the arena (it was just taken).
        let flag = unsafe { stack.noted.get_unchecked_mut(i as usize) };
        if *flag == 0 {
            *flag = 1;
            let len = stack.entries.len();
            debug_assert!(
                len < stack.entries.capacity(),
                "no room on the padded stack"
            );
            // SAFETY: every entry has its own flag, and node `i`'s was clear, so the stack
            // holds fewer entries than the arena has nodes, and it has room for one per node
            // the arena has room for: `len` is below its capacity. The entry is written before
            // the length covers it.
            unsafe {
                stack.entries.as_mut_ptr().add(len).write(i);
                stack.entries.set_len(len + 1);
            }
        }
    }

    /// Gives the padding of every node that holds some a free node of its own, in its list
    /// (the exact searches need to see all free ranges): the nodes on the padded stack, then
    /// every node from [`Tlsf::scan_from`](Tlsf) up, in index order.
    #[cold]
    #[inline(never)]
    fn list_padding(&mut self) {
        // By index: `new_node` below may grow the arena, and the stack's room with it.
        for k in 0..self.padded.entries.len() {
            let i = self.padded.entries[k];
            self.padded.noted[i as usize] = 0;
            self.list_padding_of(i);
        }
        self.padded.entries.clear();
        // The nodes `list_padding_of` makes are free: they need no look.
        let end = self.nodes.len() as u32;
        for i in self.scan_from..end {
            self.list_padding_of(i);
        }
        self.scan_from = self.nodes.len() as u32;
        self.maybe_padded = false;
    }

    /// Gives the padding node `i` holds, if any, a free node of its own, in its list (a node
    /// that is free, vacant or reserved holds none).
    #[inline(always)]
    fn list_padding_of(&mut self, i: u32) {
        {
            let (offset, pad, prev) = {
                let n = self.node(i);
                (n.offset, n.padding(), n.prev_phys)
            };
            if pad == 0 {
                return;
            }
            // [p = padding][i = allocation]
            let p = self.new_node();
            *self.node_mut(p) = Node {
                offset,
                size: pad,
                prev_phys: prev,
                next_phys: i,
                prev_free: NIL,
                next_free: NIL,
            };
            self.link(p, list_index(pad), offset, pad);
            {
                let n = self.node_mut(i);
                n.offset += pad;
                n.size -= pad;
                n.prev_phys = p;
                n.set_prev_is_free(true);
            }
            if prev != NIL {
                self.node_mut(prev).next_phys = p;
            } else {
                self.first = p;
            }
        }
    }

    /// Lists all padding, if any node may hold some (a node took padding since the last
    /// listing); before a search that must see every free range. (No count of the nodes that
    /// hold padding is kept: its upkeep, an increment per padded allocation and two
    /// decrements per free, cost about 2% of the VMA replica's time at alignment 16, see
    /// docs/performance.md, seventh round. Without it a listing may find nothing to list, and
    /// looks at each entry and node made since the last one all the same.)
    #[inline(always)]
    pub(crate) fn list_all(&mut self) {
        if self.unlisted() {
            self.list_padding();
        }
    }

    /// Whether a node may hold padding that is not listed ([`Tlsf::maybe_padded`](Tlsf)).
    #[inline(always)]
    fn unlisted(&self) -> bool {
        self.maybe_padded
    }

    /// The first non-empty list at index `li` or above.
    #[inline(always)]
    fn first_list_from(&mut self, li: usize) -> Option<usize> {
        debug_assert!(li < LISTS);
        let li = li & (LISTS - 1);
        let fl = li / SL_COUNT;
        let here = self.lists.sl_bitmaps[fl] & (u32::MAX << (li % SL_COUNT));
        if here != 0 {
            return Some(fl * SL_COUNT + here.trailing_zeros() as usize);
        }
        // Two shifts: `fl + 1` may be 64.
        let above = self.fl_bitmap & ((u64::MAX << fl) << 1);
        if above == 0 {
            return None;
        }
        let next = above.trailing_zeros() as usize;
        let lists = self.lists.sl_bitmaps[next & 63];
        if lists != 0 {
            return Some(next * SL_COUNT + lists.trailing_zeros() as usize);
        }
        self.first_list_above(fl)
    }

    /// The first non-empty list in an octave above `fl`, once [`Tlsf::first_list_from`] has
    /// met an empty octave whose bit is set: clears the bits of the empty octaves on the way
    /// (out of line: rare).
    #[cold]
    #[inline(never)]
    fn first_list_above(&mut self, fl: usize) -> Option<usize> {
        loop {
            let above = self.fl_bitmap & ((u64::MAX << fl) << 1);
            if above == 0 {
                return None;
            }
            let next = above.trailing_zeros() as usize;
            let lists = self.lists.sl_bitmaps[next & 63];
            if lists != 0 {
                return Some(next * SL_COUNT + lists.trailing_zeros() as usize);
            }
            self.fl_bitmap &= !(1 << next);
        }
    }

    /// The non-empty list after list `li`.
    #[inline]
    fn next_list(&mut self, li: usize) -> Option<usize> {
        if li + 1 < LISTS {
            self.first_list_from(li + 1)
        } else {
            None
        }
    }

    /// The head of list `li`.
    #[inline(always)]
    fn head(&self, li: usize) -> u32 {
        self.lists.heads[li & (LISTS - 1)]
    }

    /// Finds room for `size` aligned to `align` (a power of two). Returns the free node, its
    /// list and the aligned offset inside it; nothing is changed yet.
    #[inline(always)]
    pub(crate) fn find(&mut self, size: u64, align: u64, strategy: Strategy) -> Option<Found> {
        let mask = align - 1;
        // Plain `if let` chains rather than `Option::or_else`: the closures were not always
        // inlined, and returning the pair through memory cost more than the search itself.
        let first = match strategy {
            Strategy::MinOffset => return unpack(self.lowest_fit(size, mask)),
            Strategy::MinMemory => unpack(self.best_fit(size, mask)),
            Strategy::Balanced => self.tight_fit(size, mask),
            Strategy::MinTime => None,
        };
        if first.is_some() {
            return first;
        }
        if let Some(found) = self.good_fit(size, mask) {
            return Some(found);
        }
        unpack(self.first_fit(size, mask))
    }

    /// [`Tlsf::find`] of a request of `1..=2^63` units with [`Strategy::Balanced`] (the same
    /// result, see [`Tlsf::tight_fit_bounded`]), but with the padding before the range in
    /// place of its offset: `(node, list, padding)`; the range starts at the node's offset
    /// ([`Tlsf::free_offset`]) plus the padding. Where the tight fit and the rest of the
    /// search meet, the padding is what [`Tlsf::take`] needs; given the offset, it had to
    /// find the padding again on the common path.
    #[inline(always)]
    pub(crate) fn find_balanced_bounded(&mut self, size: u64, align: u64) -> Option<Found> {
        debug_assert!((1..=1 << 63).contains(&size) && align.is_power_of_two());
        let mask = align - 1;
        if let Some(found) = self.tight_fit_bounded(size, mask) {
            return Some(found);
        }
        let (i, li, at) = unpack(self.good_or_first_fit(size, mask))?;
        Some((i, li, at - self.node(i).offset))
    }

    /// The offset of free node `i` (as found by a search).
    #[inline(always)]
    pub(crate) fn free_offset(&self, i: u32) -> u64 {
        self.node(i).offset
    }

    /// [`Tlsf::good_fit`], then [`Tlsf::first_fit`] if that fails: where the bounded
    /// Balanced search goes when its tight fit fails (4% of the aligned allocations of the
    /// VMA replica). Out of line, so that the registers of the common path are not
    /// reshuffled where the paths meet.
    #[inline(never)]
    fn good_or_first_fit(&mut self, size: u64, mask: u64) -> Packed {
        if let Some(found) = self.good_fit(size, mask) {
            return pack(Some(found));
        }
        self.first_fit(size, mask)
    }

    /// [`Tlsf::find`] of a request with alignment 1 and [`Strategy::Balanced`] (the same
    /// result, see [`Tlsf::tight_or_good_fit_unaligned`]).
    #[inline(always)]
    pub(crate) fn find_balanced_unaligned(&mut self, size: u64) -> Option<Found> {
        if let Some(found) = self.tight_or_good_fit_unaligned(size) {
            return Some(found);
        }
        unpack(self.first_fit(size, 0))
    }

    /// O(1): the head of the first list whose every block fits even with worst-case padding.
    #[inline(always)]
    fn good_fit(&mut self, size: u64, mask: u64) -> Option<Found> {
        let worst = size.checked_add(mask)?;
        let li = self.first_list_from(list_index_up(worst))?;
        let i = self.head(li);
        let n = self.node(i);
        let at = fit(n.offset, n.size, size, mask);
        debug_assert!(
            at.is_some(),
            "good-fit list holds a block that does not fit"
        );
        at.map(|at| (i, li, at))
    }

    /// O(1): the head of the first non-empty list from the one of `size` rounded up to the
    /// alignment, if it fits at its real offset. A free range that ends on an aligned offset
    /// (as it does when an allocation of that alignment follows it) holds the request exactly
    /// when it is at least that long, so this is the smallest class that can do, and its head
    /// usually does. The good fit must allow for the worst-case padding instead and takes
    /// larger ranges. (Starting from `size` alone, the probe failed half the time at
    /// alignment 256 in the VMA benchmark replica, a wasted node load, and packed worse; from
    /// the rounded size it does not fail there. With alignment 1 nothing changes.)
    #[inline(always)]
    fn tight_fit(&mut self, size: u64, mask: u64) -> Option<Found> {
        let li = self.first_list_from(list_index(size.saturating_add(mask) & !mask))?;
        let i = self.head(li);
        let n = self.node(i);
        fit(n.offset, n.size, size, mask).map(|at| (i, li, at))
    }

    /// [`Tlsf::tight_fit`] of a request of `1..=2^63` units, with the padding in place of the
    /// offset (see [`Tlsf::find_balanced_bounded`]): the same choice without
    /// overflow checks. The size plus the mask (below 2^63: an alignment is at most 2^63)
    /// and the padding (at most the mask) plus the size stay below 2^64, so the size rounds
    /// up to the alignment with a plain sum and the range fits exactly when its padding
    /// (`-offset & mask`, no sum) plus the size is at most its length; the aligned offset,
    /// then inside the range, cannot overflow either. That is two branches and the
    /// saturation's select less than `tight_fit` with `fit`'s checked sums, on every
    /// aligned allocation.
    #[inline(always)]
    fn tight_fit_bounded(&mut self, size: u64, mask: u64) -> Option<Found> {
        debug_assert!((1..=1 << 63).contains(&size) && mask < 1 << 63);
        let li = self.first_list_from(list_index((size + mask) & !mask))?;
        let i = self.head(li);
        let n = self.node(i);
        let pad = n.offset.wrapping_neg() & mask;
        (pad + size <= n.size).then_some((i, li, pad))
    }

    /// [`Tlsf::tight_fit`], then [`Tlsf::good_fit`] if that fails, for a request without
    /// alignment: the same choice in fewer steps. A range fits exactly when it is at least
    /// `size` long. Only the request's own list can hold a range too short (every range in a
    /// list above it is at least that list's floor, above `size`), and the good fit is then
    /// the first non-empty list after it: the search goes on from there instead of starting
    /// again from `size` rounded up, and neither head needs the general fit test.
    #[inline(always)]
    fn tight_or_good_fit_unaligned(&mut self, size: u64) -> Option<Found> {
        let li = self.first_list_from(list_index(size))?;
        let i = self.head(li);
        let n = self.node(i);
        if n.size >= size {
            return Some((i, li, n.offset));
        }
        debug_assert_eq!(
            li,
            list_index(size),
            "a list above the size's own held a shorter range"
        );
        let li = self.next_list(li)?;
        let i = self.head(li);
        let n = self.node(i);
        debug_assert!(
            n.size >= size,
            "good-fit list holds a block that does not fit"
        );
        Some((i, li, n.offset))
    }

    /// Counts a free range looked at by a search (tests only).
    #[inline(always)]
    fn examine(&mut self) {
        #[cfg(test)]
        {
            self.examined += 1;
        }
    }

    /// Walks the lists that may hold a fitting block, lowest size first; the first block that
    /// fits wins. This is the exact fallback that rules out false out-of-memory failures.
    /// Lists whose summary rules them out are skipped; a list walked to its end without a fit
    /// gets a summary (see [`FitSummaries`]), so a failure costs a walk only the first time.
    #[inline(never)]
    fn first_fit(&mut self, size: u64, mask: u64) -> Packed {
        self.list_all();
        let align_log2 = mask.count_ones();
        let mut list = self.first_list_from(list_index(size));
        while let Some(li) = list {
            if !self.summaries.rules_out(li, size, align_log2) {
                let mut i = self.head(li);
                let mut most = 0;
                while i != NIL {
                    self.examine();
                    let n = self.node(i);
                    if let Some(at) = fit(n.offset, n.size, size, mask) {
                        return pack(Some((i, li, at)));
                    }
                    most = most.max(fit_at(n.offset, n.size, align_log2));
                    i = n.next_free;
                }
                self.summaries.set(li, align_log2, most);
            }
            list = self.next_list(li);
        }
        NOT_FOUND
    }

    /// The smallest fitting block (ties: lowest offset) among the first [`BEST_FIT_BUDGET`]
    /// blocks examined. Lists are ordered by size, so the search starts at the request's own
    /// list and stops at the first list that holds a fitting block; the budget bounds the walk
    /// when many small blocks fail the alignment (then the good fit takes over). Lists ruled
    /// out by their summaries are skipped without using the budget.
    #[inline(never)]
    fn best_fit(&mut self, size: u64, mask: u64) -> Packed {
        self.list_all();
        let align_log2 = mask.count_ones();
        let mut list = self.first_list_from(list_index(size));
        let mut budget = BEST_FIT_BUDGET;
        let mut best: Option<Found> = None;
        while let Some(li) = list {
            if self.summaries.rules_out(li, size, align_log2) {
                list = self.next_list(li);
                continue;
            }
            let mut i = self.head(li);
            while i != NIL {
                self.examine();
                let n = self.node(i);
                if let Some(at) = fit(n.offset, n.size, size, mask) {
                    let better = best.is_none_or(|(b, _, _)| {
                        let b = self.node(b);
                        (n.size, n.offset) < (b.size, b.offset)
                    });
                    if better {
                        best = Some((i, li, at));
                    }
                }
                budget -= 1;
                if budget == 0 {
                    return pack(best);
                }
                i = n.next_free;
            }
            if best.is_some() {
                return pack(best);
            }
            list = self.next_list(li);
        }
        NOT_FOUND
    }

    /// The fitting block with the lowest offset (O(free ranges)). Lists ruled out by their
    /// summaries are skipped; a list without a fitting block gets a summary.
    #[inline(never)]
    fn lowest_fit(&mut self, size: u64, mask: u64) -> Packed {
        self.list_all();
        let align_log2 = mask.count_ones();
        let mut best: Option<Found> = None;
        let mut list = self.first_list_from(list_index(size));
        while let Some(li) = list {
            if !self.summaries.rules_out(li, size, align_log2) {
                let mut i = self.head(li);
                let mut most = 0;
                let mut fits_here = false;
                while i != NIL {
                    self.examine();
                    let n = self.node(i);
                    match fit(n.offset, n.size, size, mask) {
                        Some(at) => {
                            fits_here = true;
                            if best.is_none_or(|(_, _, b)| at < b) {
                                best = Some((i, li, at));
                            }
                        }
                        None => most = most.max(fit_at(n.offset, n.size, align_log2)),
                    }
                    i = n.next_free;
                }
                if !fits_here {
                    self.summaries.set(li, align_log2, most);
                }
            }
            list = self.next_list(li);
        }
        pack(best)
    }

    /// Gives free node `i` the range `[offset, offset + size)`, which contains its old one (a
    /// merge). It changes lists only when its size class does, which spares two list updates
    /// when a small range merges into a big one; staying, it is noted in its list's summary
    /// (the range may hold more than before).
    #[inline(always)]
    fn grow_free(&mut self, i: u32, offset: u64, size: u64) {
        let from = list_index(self.node(i).size);
        let to = list_index(size);
        if from != to {
            self.unlink(i, from);
            self.link(i, to, offset, size);
        } else {
            self.summaries.note(to, offset, size);
        }
        let n = self.node_mut(i);
        n.offset = offset;
        n.size = size;
    }

    /// Takes `[at, at + size)` out of free node `i` of list `li` (as found by [`Tlsf::find`])
    /// and gives it to `kind`. Returns the node that now describes the taken range.
    ///
    /// Node `i` stays free and keeps what is left after the range (or, if nothing is, the
    /// padding before it), so it usually keeps its list too; the taken range gets a node of its
    /// own, which also holds the padding before it (a used node; a reserved one has no
    /// alignment to find its start by, so its padding gets a free node). Padding and rest
    /// never touch another free node, since free nodes never sit side by side.
    #[inline(always)]
    pub(crate) fn take(&mut self, i: u32, li: usize, at: u64, size: u64, kind: NodeKind) -> u32 {
        let (offset, total, prev) = {
            let n = self.node(i);
            (n.offset, n.size, n.prev_phys)
        };
        let pad = at - offset;
        let rest = total - pad - size;
        if rest == 0 {
            // Rare: the range ends where the free node does.
            return self.take_tail(i, li, at, size, taken_words(kind));
        }
        if pad > 0 && !matches!(kind, NodeKind::Used { .. }) {
            return self.take_with_free_padding(i, li, at, size, kind);
        }
        // Layout: [taken u, with the padding][i = rest]. What is left after the range stays
        // in node i, which changes lists only when its size class does: a shrinking range
        // cannot break its list's summary, and a new list notes it in `link`.
        let u = self.new_node();
        let to = list_index(rest);
        if to != li {
            self.unlink(i, li);
            self.link(i, to, at + size, rest);
        }
        {
            let n = self.node_mut(i);
            n.offset = at + size;
            n.size = rest;
            n.prev_phys = u;
        }
        let mut taken = Node {
            offset,
            size: pad + size,
            prev_phys: prev,
            next_phys: i,
            prev_free: NIL,
            next_free: NIL,
        };
        taken.set_taken(kind);
        debug_assert_eq!(
            taken.start(),
            at,
            "an allocation starts at its first aligned offset"
        );
        *self.node_mut(u) = taken;
        if pad > 0 {
            self.add_padded(u);
        }
        if prev != NIL {
            self.node_mut(prev).next_phys = u;
        } else {
            self.first = u;
        }
        u
    }

    /// [`Tlsf::take`] of a reserved range after padding: the padding gets a free node.
    #[cold]
    #[inline(never)]
    fn take_with_free_padding(
        &mut self,
        i: u32,
        li: usize,
        at: u64,
        size: u64,
        kind: NodeKind,
    ) -> u32 {
        let (offset, prev) = {
            let n = self.node(i);
            (n.offset, n.prev_phys)
        };
        // Give node i's first `at - offset` units to a free node p, then take from the rest.
        let pad = at - offset;
        let p = self.new_node();
        *self.node_mut(p) = Node {
            offset,
            size: pad,
            prev_phys: prev,
            next_phys: i,
            prev_free: NIL,
            next_free: NIL,
        };
        self.link(p, list_index(pad), offset, pad);
        if prev != NIL {
            self.node_mut(prev).next_phys = p;
        } else {
            self.first = p;
        }
        let rest = self.node(i).size - pad;
        let to = list_index(rest);
        if to != li {
            self.unlink(i, li);
            self.link(i, to, at, rest);
        }
        {
            let n = self.node_mut(i);
            n.offset = at;
            n.size = rest;
            n.prev_phys = p;
        }
        // No padding left: an ordinary take. (Two free nodes side by side for a moment.) The
        // taken node comes after p, which is free.
        let u = self.take(i, to, at, size, kind);
        self.node_mut(u).set_prev_is_free(true);
        u
    }

    /// [`Tlsf::take`] when nothing of free node `i` is left after the range: node `i` becomes
    /// the range itself or keeps only the padding before it; `words` are the taken node's
    /// ([`taken_words`]). Out of line: it is rare, and the common path stays short.
    #[cold]
    #[inline(never)]
    fn take_tail(&mut self, i: u32, li: usize, at: u64, size: u64, words: (u32, u32)) -> u32 {
        let (offset, next) = {
            let n = self.node(i);
            (n.offset, n.next_phys)
        };
        let pad = at - offset;
        if pad == 0 {
            self.unlink(i, li);
            // Node i's neighbours are taken (free nodes never touch): i's word gets PREV_FREE
            // clear, and the next node's bit clears now that i is taken.
            self.node_mut(i).set_taken_words(words);
            if next != NIL {
                self.node_mut(next).set_prev_is_free(false);
            }
            return i;
        }
        // Layout: [i = padding][taken u].
        let to = list_index(pad);
        if to != li {
            self.unlink(i, li);
            self.link(i, to, offset, pad);
        }
        let u = self.new_node();
        let mut taken = Node {
            offset: at,
            size,
            prev_phys: i,
            next_phys: next,
            prev_free: NIL,
            next_free: NIL,
        };
        taken.set_taken_words(words);
        taken.set_prev_is_free(true);
        *self.node_mut(u) = taken;
        {
            let n = self.node_mut(i);
            n.size = pad;
            n.next_phys = u;
        }
        if next != NIL {
            let n = self.node_mut(next);
            n.prev_phys = u;
            n.set_prev_is_free(false);
        } else {
            self.last = u;
        }
        u
    }

    /// Returns taken node `i` to the free space, merged with free neighbours (O(1)), padding
    /// included: its own, and the padding the next node holds, which this free range takes
    /// over. A free neighbour absorbs it, so its list changes only if its size class does.
    #[inline(always)]
    pub(crate) fn release(&mut self, i: u32) {
        let start = self.node(i).start();
        self.release_from(i, start);
    }

    /// [`Tlsf::release`] of taken node `i` whose allocation starts at `start` (as
    /// [`Tlsf::record`] found it).
    #[inline(always)]
    pub(crate) fn release_from(&mut self, i: u32, start: u64) {
        debug_assert!(matches!(
            self.node(i).kind(),
            NodeKind::Used { .. } | NodeKind::Reserved(_)
        ));
        debug_assert_eq!(start, self.node(i).start());
        let (offset, mut size, prev, next, prev_free) = {
            let n = self.node(i);
            (n.offset, n.size, n.prev_phys, n.next_phys, n.prev_is_free())
        };
        debug_assert_eq!(prev_free, prev != NIL && self.node(prev).is_free());
        let mut next_free = false;
        if next != NIL {
            let n = self.node_mut(next);
            if n.is_free() {
                next_free = true;
            } else {
                // A free range ends before it now, i or the one i merges into.
                n.set_prev_is_free(true);
                // Take over the next allocation's padding, if any (without a branch).
                let pad = n.taken_padding();
                n.offset += pad;
                n.size -= pad;
                size += pad;
            }
        }
        match (prev_free, next_free) {
            (false, false) => {
                self.link(i, list_index(size), offset, size);
                self.node_mut(i).size = size;
            }
            (false, true) => {
                let n_size = self.node(next).size;
                self.grow_free(next, offset, n_size + size);
                self.node_mut(next).prev_phys = prev;
                if prev != NIL {
                    self.node_mut(prev).next_phys = next;
                } else {
                    self.first = next;
                }
                self.recycle(i);
            }
            (true, false) => {
                let (p_off, p_size) = {
                    let p = self.node(prev);
                    (p.offset, p.size)
                };
                self.grow_free(prev, p_off, p_size + size);
                self.node_mut(prev).next_phys = next;
                if next != NIL {
                    self.node_mut(next).prev_phys = prev;
                } else {
                    self.last = prev;
                }
                self.recycle(i);
            }
            (true, true) => {
                let (n_size, after) = {
                    let n = self.node(next);
                    (n.size, n.next_phys)
                };
                self.unlink_free(next);
                let (p_off, p_size) = {
                    let p = self.node(prev);
                    (p.offset, p.size)
                };
                self.grow_free(prev, p_off, p_size + size + n_size);
                self.node_mut(prev).next_phys = after;
                if after != NIL {
                    self.node_mut(after).prev_phys = prev;
                } else {
                    self.last = prev;
                }
                self.recycle(i);
                self.recycle(next);
            }
        }
        if self.first == self.last {
            self.restart();
        }
    }

    /// The block is one free range again: starts the arena afresh, in O(1). Without this,
    /// the next allocations would take vacant nodes in the order the frees left them,
    /// scattered over the whole arena (a cache miss per node); from an empty arena they are
    /// laid out one after the other.
    #[cold]
    #[inline(never)]
    fn restart(&mut self) {
        let only = self.first;
        debug_assert!(self.node(only).is_free());
        self.unlink_free(only);
        // `Node` has no drop glue and the stacks hold plain indices: all O(1).
        self.nodes.clear();
        self.vacant.clear();
        self.padded.clear();
        self.scan_from = 0;
        self.maybe_padded = false;
        self.first = NIL;
        self.last = NIL;
        let capacity = std::mem::take(&mut self.capacity);
        self.grow(capacity);
    }

    /// Changes who owns taken node `i` (used when a defragmentation move is committed).
    pub(crate) fn set_kind(&mut self, i: u32, kind: NodeKind) {
        debug_assert!(!matches!(
            self.nodes[i as usize].kind(),
            NodeKind::Free | NodeKind::Vacant
        ));
        let n = &mut self.nodes[i as usize];
        let prev_free = n.prev_is_free();
        n.set_taken(kind);
        n.set_prev_is_free(prev_free);
    }

    /// The live allocation whose identity is node `i`, if there is one.
    #[inline(always)]
    pub(crate) fn record(&self, i: u32) -> Option<Record> {
        let n = self.nodes.get(i as usize)?;
        if n.prev_free & KIND_MASK != USED {
            return None;
        }
        let start = n.start();
        Some(Record {
            offset: start,
            size: n.offset + n.size - start,
            meta: n.prev_free & META_MASK,
            generation: n.next_free,
        })
    }

    /// Replaces the meta of used node `i`.
    pub(crate) fn set_meta(&mut self, i: u32, meta: u32) {
        let n = &mut self.nodes[i as usize];
        debug_assert_eq!(n.prev_free & KIND_MASK, USED);
        n.prev_free = USED | (meta & META_MASK) | (n.prev_free & PREV_FREE);
    }

    pub(crate) fn kind(&self, i: u32) -> NodeKind {
        self.nodes
            .get(i as usize)
            .map_or(NodeKind::Vacant, Node::kind)
    }

    pub(crate) fn prev_phys(&self, i: u32) -> u32 {
        self.nodes[i as usize].prev_phys
    }

    pub(crate) fn next_phys(&self, i: u32) -> u32 {
        self.nodes[i as usize].next_phys
    }

    /// The list of free node `i`.
    pub(crate) fn list_of(&self, i: u32) -> usize {
        list_index(self.nodes[i as usize].size)
    }

    /// The range of taken node `i`'s allocation (its padding left out).
    pub(crate) fn node_range(&self, i: u32) -> (u64, u64) {
        let n = &self.nodes[i as usize];
        let pad = n.padding();
        (n.offset + pad, n.size - pad)
    }

    /// Extends the block to `capacity` (not smaller than now): the tail becomes free space,
    /// merged with a free last node.
    pub(crate) fn grow(&mut self, capacity: u64) {
        debug_assert!(capacity >= self.capacity);
        let extra = capacity - self.capacity;
        if extra == 0 {
            return;
        }
        let old = self.capacity;
        self.capacity = capacity;
        if self.last != NIL && self.nodes[self.last as usize].is_free() {
            let l = self.last;
            self.unlink_free(l);
            self.nodes[l as usize].size += extra;
            self.link_free(l);
            return;
        }
        let prev = self.last;
        let n = self.new_node();
        *self.node_mut(n) = Node {
            offset: old,
            size: extra,
            prev_phys: prev,
            next_phys: NIL,
            prev_free: NIL,
            next_free: NIL,
        };
        if prev != NIL {
            self.nodes[prev as usize].next_phys = n;
        } else {
            self.first = n;
        }
        self.last = n;
        self.link_free(n);
    }

    /// Forgets every region: one free node covers the block again. Keeps the arena's memory.
    pub(crate) fn clear(&mut self) {
        let capacity = self.capacity;
        self.nodes.clear();
        self.vacant.clear();
        self.padded.clear();
        self.scan_from = 0;
        self.maybe_padded = false;
        self.first = NIL;
        self.last = NIL;
        self.capacity = 0;
        self.fl_bitmap = 0;
        self.lists.sl_bitmaps = [0; 64];
        self.lists.heads.fill(NIL);
        self.summaries.clear();
        self.grow(capacity);
    }

    /// A lower bound on the largest free range in O(1): the largest range itself when its
    /// list (the top non-empty one) holds only it, as it usually does, else that list's floor,
    /// at most 1/32 below the largest listed range. (After a failed allocation every range is
    /// listed; otherwise unlisted padding, smaller than an alignment, may be larger still.)
    pub(crate) fn largest_free_at_least(&self) -> u64 {
        let Some(li) = self.top_list() else {
            return 0;
        };
        let n = &self.nodes[self.head(li) as usize];
        if n.next_free == NIL {
            n.size
        } else {
            list_floor(li)
        }
    }

    /// The highest non-empty list, if any (skipping the emptied octaves whose bits no search
    /// has cleared yet).
    fn top_list(&self) -> Option<usize> {
        let mut octaves = self.fl_bitmap;
        while octaves != 0 {
            let fl = 63 - octaves.leading_zeros() as usize;
            let lists = self.lists.sl_bitmaps[fl];
            if lists != 0 {
                return Some(fl * SL_COUNT + 31 - lists.leading_zeros() as usize);
            }
            octaves &= !(1 << fl);
        }
        None
    }

    /// The size of the largest free range, exactly: the top non-empty list is found from the
    /// bitmaps, then that one list is scanned (its blocks differ by at most 1/32), and the
    /// padding nodes hold is looked at; the cost is the length of that list and, if any node
    /// holds padding, of the padded stack and the nodes made since the last listing.
    pub(crate) fn largest_free(&self) -> u64 {
        let mut best = 0;
        if let Some(li) = self.top_list() {
            let mut i = self.head(li);
            while i != NIL {
                let n = &self.nodes[i as usize];
                best = best.max(n.size);
                i = n.next_free;
            }
        }
        if self.unlisted() {
            let unlisted = self.scan_from as usize..self.nodes.len();
            for i in self
                .padded
                .entries
                .iter()
                .map(|&i| i as usize)
                .chain(unlisted)
            {
                best = best.max(self.nodes[i].padding());
            }
        }
        best
    }

    /// Count, sum and sum of squares of the free ranges, by a walk over every range
    /// (O(ranges)).
    pub(crate) fn free_totals(&self) -> FreeTotals {
        let mut totals = FreeTotals::default();
        for (_, _, size, kind) in self.regions() {
            if kind == NodeKind::Free {
                totals.add(size);
            }
        }
        totals
    }

    /// The taken regions in offset order: `(node, offset, size, kind)`, padding left out.
    pub(crate) fn taken(&self) -> TakenIter<'_> {
        TakenIter {
            tlsf: self,
            next: self.first,
        }
    }

    /// Every region in offset order, free ones included: the padding a node holds comes first
    /// as a free region of node `NIL`, then the node's allocation.
    pub(crate) fn regions(&self) -> impl Iterator<Item = (u32, u64, u64, NodeKind)> + '_ {
        let mut cur = self.first;
        let mut held = None;
        std::iter::from_fn(move || {
            if let Some(r) = held.take() {
                return Some(r);
            }
            if cur == NIL {
                return None;
            }
            let i = cur;
            let n = &self.nodes[i as usize];
            cur = n.next_phys;
            let pad = n.padding();
            if pad > 0 {
                held = Some((i, n.offset + pad, n.size - pad, n.kind()));
                return Some((NIL, n.offset, pad, NodeKind::Free));
            }
            Some((i, n.offset, n.size, n.kind()))
        })
    }

    /// The nodes that hold padding (tests only: O(nodes)).
    #[cfg(test)]
    fn padded_nodes(&self) -> usize {
        (0..self.nodes.len())
            .filter(|&i| self.nodes[i].padding() > 0)
            .count()
    }

    /// Checks every structural invariant; the first broken one is described in the error.
    pub(crate) fn validate(&self) -> Result<(), String> {
        let mut expected_offset = 0u64;
        let mut prev = NIL;
        let mut prev_free = false;
        let mut seen = 0usize;
        let mut totals = FreeTotals::default();
        let mut padded = 0u32;
        let mut on_stack = vec![false; self.nodes.len()];
        for &i in &self.padded.entries {
            let seen = on_stack
                .get_mut(i as usize)
                .ok_or_else(|| format!("padded entry {i} out of the arena"))?;
            if std::mem::replace(seen, true) {
                return Err(format!("node {i} twice on the padded stack"));
            }
            if self.padded.noted[i as usize] != 1 {
                return Err(format!("padded entry {i} without its flag"));
            }
        }
        let flags = self.padded.noted.iter().filter(|&&f| f != 0).count();
        if flags != self.padded.entries.len() {
            return Err(format!(
                "{flags} noted flags for {} padded entries",
                self.padded.entries.len()
            ));
        }
        if !self.padded.entries.is_empty() && !self.maybe_padded {
            return Err("padded stack not empty, but maybe_padded is clear".into());
        }
        if let Some(&i) = self.padded.entries.iter().find(|&&i| i >= self.scan_from) {
            return Err(format!(
                "padded entry {i} at or above scan_from {}",
                self.scan_from
            ));
        }
        if self.scan_from as usize > self.nodes.len() {
            return Err(format!(
                "scan_from {} beyond the arena ({} nodes)",
                self.scan_from,
                self.nodes.len()
            ));
        }
        let room = self.padded.noted.len();
        if room < self.nodes.len() || self.padded.entries.capacity() < room {
            return Err(format!(
                "padded stack: room for {room} nodes and {} entries, {} nodes",
                self.padded.entries.capacity(),
                self.nodes.len()
            ));
        }
        let mut cur = self.first;
        while cur != NIL {
            let n = self
                .nodes
                .get(cur as usize)
                .ok_or_else(|| format!("node {cur} out of the arena"))?;
            seen += 1;
            if seen > self.nodes.len() {
                return Err("physical list has a cycle".into());
            }
            if n.prev_phys != prev {
                return Err(format!("node {cur}: prev_phys {} != {prev}", n.prev_phys));
            }
            if n.offset != expected_offset {
                return Err(format!(
                    "node {cur}: offset {} != {expected_offset}",
                    n.offset
                ));
            }
            if n.size == 0 {
                return Err(format!("node {cur}: zero size"));
            }
            let free = match n.kind() {
                NodeKind::Free => true,
                NodeKind::Used { .. } | NodeKind::Reserved(_) => false,
                NodeKind::Vacant => return Err(format!("node {cur}: vacant node in the block")),
            };
            if free && prev_free {
                return Err(format!("node {cur}: two free neighbours not merged"));
            }
            if !free && n.prev_is_free() != prev_free {
                return Err(format!("node {cur}: PREV_FREE bit is not {prev_free}"));
            }
            if !free {
                // Padding: less than the alignment, noted, and not next to a free range
                // (which would have taken it over).
                let pad = n.padding();
                if pad >= 1 << (n.prev_free & ALIGN_BITS) || pad >= n.size {
                    return Err(format!("node {cur}: padding {pad} too large"));
                }
                if pad > 0 {
                    totals.add(pad);
                    padded += 1;
                    if !on_stack[cur as usize] && cur < self.scan_from {
                        return Err(format!("node {cur} holds padding but is not noted"));
                    }
                    if prev_free {
                        return Err(format!("node {cur}: padding after a free range"));
                    }
                }
            } else {
                totals.add(n.size);
                let li = list_index(n.size);
                let (fl, sl) = (li / SL_COUNT, li % SL_COUNT);
                if self.lists.sl_bitmaps[fl] & (1 << sl) == 0 || self.fl_bitmap & (1 << fl) == 0 {
                    return Err(format!("node {cur}: its list's bitmap bit is clear"));
                }
                let mut j = self.head(li);
                let mut steps = 0usize;
                while j != NIL && j != cur {
                    j = self
                        .nodes
                        .get(j as usize)
                        .ok_or_else(|| format!("free link {j} out of the arena"))?
                        .next_free;
                    steps += 1;
                    if steps > self.nodes.len() {
                        return Err("free list has a cycle".into());
                    }
                }
                if j != cur {
                    return Err(format!("node {cur}: free but not in list {li}"));
                }
                if !self.summaries.covers(li, n.offset, n.size) {
                    return Err(format!("node {cur}: list {li}'s fit summary is too low"));
                }
            }
            expected_offset = n
                .offset
                .checked_add(n.size)
                .ok_or_else(|| format!("node {cur}: end overflows"))?;
            prev_free = free;
            prev = cur;
            cur = n.next_phys;
        }
        if expected_offset != self.capacity {
            return Err(format!(
                "regions end at {expected_offset}, block is {}",
                self.capacity
            ));
        }
        if prev != self.last {
            return Err("`last` is not the final node".into());
        }
        // Every list: links consistent, members free and of the right size, list bitmaps
        // exact, and an octave with a non-empty list has its bit set.
        let mut listed = 0u32;
        for fl in 0..self.lists.sl_bitmaps.len() {
            if (self.fl_bitmap >> fl) & 1 == 0 && self.lists.sl_bitmaps[fl] != 0 {
                return Err(format!(
                    "octave {fl}: bitmap bit clear, a list is not empty"
                ));
            }
            for sl in 0..SL_COUNT {
                let li = fl * SL_COUNT + sl;
                let mut j = self.head(li);
                if (self.lists.sl_bitmaps[fl] >> sl) & 1 != u32::from(j != NIL) {
                    return Err(format!("list ({fl},{sl}): bitmap bit disagrees"));
                }
                let mut p = NIL;
                while j != NIL {
                    let n = self
                        .nodes
                        .get(j as usize)
                        .ok_or_else(|| format!("list link {j} out of the arena"))?;
                    if !n.is_free() || list_index(n.size) != li {
                        return Err(format!("node {j} in list {li} does not belong"));
                    }
                    if n.prev_free != p {
                        return Err(format!("node {j}: prev_free link broken"));
                    }
                    listed += 1;
                    if listed > totals.count {
                        return Err("more listed nodes than free regions".into());
                    }
                    p = j;
                    j = n.next_free;
                }
            }
        }
        if listed + padded != totals.count {
            return Err(format!(
                "{listed} listed nodes and {padded} paddings, {} free regions",
                totals.count
            ));
        }
        if padded != 0 && !self.unlisted() {
            return Err(format!(
                "{padded} nodes hold padding, but none is on the stack or unlisted"
            ));
        }
        let vacant = self.vacant.len();
        let mut stacked = vec![false; self.nodes.len()];
        for &v in &self.vacant {
            if self.kind(v) != NodeKind::Vacant {
                return Err(format!("node {v} on the vacant stack is in use"));
            }
            if std::mem::replace(&mut stacked[v as usize], true) {
                return Err(format!("node {v} is on the vacant stack twice"));
            }
        }
        if vacant + seen != self.nodes.len() {
            return Err(format!(
                "{} nodes, {seen} in the block, {vacant} vacant",
                self.nodes.len()
            ));
        }
        Ok(())
    }
}

/// Iterator over taken regions, see [`Tlsf::taken`].
pub(crate) struct TakenIter<'a> {
    tlsf: &'a Tlsf,
    next: u32,
}

impl Iterator for TakenIter<'_> {
    type Item = (u32, u64, u64, NodeKind);
    fn next(&mut self) -> Option<Self::Item> {
        while self.next != NIL {
            let i = self.next;
            let n = &self.tlsf.nodes[i as usize];
            self.next = n.next_phys;
            if !n.is_free() {
                let pad = n.padding();
                return Some((i, n.offset + pad, n.size - pad, n.kind()));
            }
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lists_partition_sizes() {
        // Every size maps to a list whose floor is <= size < next floor, and rounding up gives
        // the first list whose floor is >= size.
        let mut sizes: Vec<u64> = (1..2000).collect();
        for shift in 11..64 {
            let p = 1u64 << shift;
            sizes.extend([p - 1, p, p + 1, p + p / 3]);
        }
        sizes.push(u64::MAX);
        for s in sizes {
            let li = list_index(s);
            assert!(li < 60 * SL_COUNT, "size {s}");
            assert!(list_floor(li) <= s, "size {s}");
            if li + 1 < 60 * SL_COUNT {
                assert!(s < list_floor(li + 1), "size {s} beyond its list");
            }
            let up = list_index_up(s);
            assert!(up == li || up == li + 1, "size {s}");
            if up < 60 * SL_COUNT {
                assert!(list_floor(up) >= s, "size {s} rounded down");
            }
            assert_eq!(up == li, list_floor(li) == s, "size {s}");
        }
    }

    #[test]
    fn unaligned_balanced_search_chooses_as_the_general_one() {
        // Random allocations and frees at mixed alignments; before every allocation of
        // alignment 1, the search made for it must pick what `find` picks.
        let mut t = Tlsf::new(1 << 16);
        let mut live: Vec<u32> = Vec::new();
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        let mut compared = 0;
        for _ in 0..4000 {
            let r = next();
            if r % 3 == 0 && !live.is_empty() {
                let i = live.swap_remove((r / 3 % live.len() as u64) as usize);
                t.release(i);
                continue;
            }
            let size = next() % 700 + 1;
            let align = [1u64, 1, 1, 16, 64][(next() % 5) as usize];
            let found = t.find(size, align, Strategy::Balanced);
            if align == 1 {
                assert_eq!(t.find_balanced_unaligned(size), found, "size {size}");
                compared += 1;
            }
            let Some((i, li, at)) = found else { continue };
            let kind = NodeKind::Used {
                meta: align.trailing_zeros(),
                generation: 1,
            };
            live.push(t.take(i, li, at, size, kind));
        }
        t.validate().unwrap();
        assert!(compared > 1000);
    }

    #[test]
    fn bounded_balanced_search_chooses_as_the_general_one() {
        // Random allocations and frees at mixed alignments; before every allocation, the
        // search for sizes up to 2^63 must pick what `find` picks, also for sizes that fit
        // nowhere (up to 2^63, with alignments up to 2^63).
        let mut t = Tlsf::new(1 << 16);
        let mut live: Vec<u32> = Vec::new();
        let mut x = 0x2545_f491_4f6c_dd1du64;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        let mut compared = 0;
        for _ in 0..4000 {
            let r = next();
            if r % 3 == 0 && !live.is_empty() {
                let i = live.swap_remove((r / 3 % live.len() as u64) as usize);
                t.release(i);
                continue;
            }
            let (size, align) = if r % 50 == 1 {
                (1 << (62 + next() % 2), 1 << (next() % 64))
            } else {
                let align = [1u64, 2, 16, 16, 64, 256, 4096][(next() % 7) as usize];
                (next() % 900 + 1, align)
            };
            let found = t.find(size, align, Strategy::Balanced);
            let bounded = t.find_balanced_bounded(size, align);
            assert_eq!(
                bounded.map(|(i, li, pad)| (i, li, t.free_offset(i) + pad)),
                found,
                "size {size} align {align}"
            );
            compared += 1;
            let Some((i, li, at)) = found else { continue };
            let kind = NodeKind::Used {
                meta: align.trailing_zeros(),
                generation: 1,
            };
            live.push(t.take(i, li, at, size, kind));
        }
        t.validate().unwrap();
        assert!(compared > 2000);
    }

    #[test]
    fn padded_stack_keeps_room_through_growth_clone_listing_and_restart() {
        // The padded stack is pushed without a capacity check: its room must follow the
        // arena as it grows, survive a clone (`Vec::clone` keeps only the length), a listing
        // of the padding and a restart. `validate` checks the room and the flags.
        let mut x = 0x2545_f491_4f6c_dd1du64;
        let mut next = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        let mut churn = |t: &mut Tlsf, live: &mut Vec<u32>, steps: usize| {
            for _ in 0..steps {
                let r = next();
                if r % 3 == 0 && !live.is_empty() {
                    let i = live.swap_remove((r / 3 % live.len() as u64) as usize);
                    t.release(i);
                    continue;
                }
                let size = next() % 300 + 1;
                let align = [16u64, 64, 256][(next() % 3) as usize];
                let Some((i, li, at)) = t.find(size, align, Strategy::Balanced) else {
                    continue;
                };
                let kind = NodeKind::Used {
                    meta: align.trailing_zeros(),
                    generation: 1,
                };
                live.push(t.take(i, li, at, size, kind));
            }
            t.validate().unwrap();
        };
        let mut t = Tlsf::new(1 << 20);
        let mut live = Vec::new();
        churn(&mut t, &mut live, 3000);
        assert!(t.padded_nodes() > 0);
        let mut copy = t.clone();
        let mut copy_live = live.clone();
        copy.validate().unwrap();
        // More nodes than the original ever had: the clone's arena grows.
        churn(&mut copy, &mut copy_live, 6000);
        copy.list_all();
        copy.validate().unwrap();
        assert_eq!(copy.padded_nodes(), 0);
        assert!(!copy.unlisted());
        churn(&mut copy, &mut copy_live, 2000);
        for i in copy_live.drain(..) {
            copy.release(i);
        }
        copy.validate().unwrap();
        assert_eq!(copy.padded.entries.len(), 0);
        churn(&mut copy, &mut copy_live, 2000);
        // The original is untouched by all this.
        churn(&mut t, &mut live, 1000);
    }

    #[test]
    fn padding_of_nodes_from_scan_from_up_is_listed_without_stack_entries() {
        // Nodes at or above `scan_from` take padding without a stack entry; a listing looks at
        // them by index and moves `scan_from` to the arena's end, after which reused nodes
        // below it are pushed again. Every padding must reach the lists either way.
        let mut t = Tlsf::new(1 << 16);
        let kind = NodeKind::Used {
            meta: 4,
            generation: 1,
        };
        let mut live = Vec::new();
        for k in 0..200u64 {
            let size = k % 37 + 1;
            let (i, li, at) = t.find(size, 16, Strategy::Balanced).unwrap();
            live.push(t.take(i, li, at, size, kind));
        }
        assert!(t.padded_nodes() > 0);
        assert!(t.padded.entries.is_empty(), "a fresh arena pushes nothing");
        t.validate().unwrap();
        let largest = t.largest_free();
        t.list_all();
        t.validate().unwrap();
        assert_eq!(t.largest_free(), largest);
        assert_eq!(t.scan_from as usize, t.nodes.len());
        // Free every other allocation, and allocate again: reused nodes (below `scan_from`)
        // go on the stack, new ones (above it) do not.
        for k in (0..live.len()).rev().step_by(2) {
            t.release(live.swap_remove(k));
        }
        for k in 0..300u64 {
            let size = k % 53 + 1;
            let (i, li, at) = t.find(size, 16, Strategy::Balanced).unwrap();
            live.push(t.take(i, li, at, size, kind));
        }
        assert!(!t.padded.entries.is_empty());
        assert!((t.scan_from as usize) < t.nodes.len());
        t.validate().unwrap();
        let largest = t.largest_free();
        t.list_all();
        t.validate().unwrap();
        assert_eq!(t.padded_nodes(), 0);
        assert_eq!(t.largest_free(), largest);
        for i in live.drain(..) {
            t.release(i);
        }
        t.validate().unwrap();
        assert_eq!(t.scan_from, 0, "an empty block starts the arena afresh");
    }

    #[test]
    fn take_and_release_merge_back() {
        let mut t = Tlsf::new(1000);
        let (i, li, at) = t.find(10, 16, Strategy::Balanced).unwrap();
        // The low bits of a used node's meta are log2 of its alignment.
        let used = |align: u64, generation| NodeKind::Used {
            meta: align.trailing_zeros(),
            generation,
        };
        let a = t.take(i, li, at, 10, used(16, 0));
        let (j, lj, at2) = t.find(100, 64, Strategy::Balanced).unwrap();
        let b = t.take(j, lj, at2, 100, used(64, 1));
        assert_eq!(at % 16, 0);
        assert_eq!(at2 % 64, 0);
        t.validate().unwrap();
        t.release(a);
        t.validate().unwrap();
        t.release(b);
        t.validate().unwrap();
        assert_eq!(t.regions().filter(|r| r.3 == NodeKind::Free).count(), 1);
        assert_eq!(t.largest_free(), 1000);
    }
}
