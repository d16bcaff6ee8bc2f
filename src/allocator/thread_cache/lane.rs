//! One lane of a thread cache: a bin per size class and the class's counts.
//!
//! Lane 0 is the `SystemAllocator`'s own. The others belong to child allocators of the
//! `SystemAllocator` (see `crate::allocator::lanes`): a child whose lane is open takes and
//! gives back blocks exactly as the `SystemAllocator` does, only in its own lane, so its
//! counts fall out of the lane's per-class counters instead of being kept by a second set
//! of counters on every call. Every lane draws from and returns to the same heap: a bin
//! holds free blocks of its class, whatever lane they were last allocated from.

use super::counts;
use super::{HEAP, HOOK_FREE, HOOK_FREE_SAMPLED, HOOK_GUARD, HOOK_TAGS, cold_path};
use crate::allocator::guarded;
use crate::records;
use crate::schema::hpha::Tag;
use crate::schema::hpha::size_class::{
    CLASS_BY_UNITS, CLASS_COUNT, CLASS_SIZES, MAX_SMALL, class_size, fast_units,
};
use crate::schema::hpha::small::{FreeSlot, SmallHeap, check_free, mark_allocated};
use crate::stats::ShardSum;
use core::alloc::Layout;
use core::cell::UnsafeCell;
use core::ptr::{self, null_mut};
use core::sync::atomic::{
    AtomicBool, AtomicPtr, AtomicU8, AtomicU16, AtomicU32, AtomicU64, AtomicUsize, Ordering::*,
    compiler_fence, fence,
};

/// Bytes a bin may hold before it gives half back, bounded in blocks below.
const BIN_BYTES: usize = 16 * 1024;
const MIN_BIN_BLOCKS: usize = 4;
const MAX_BIN_BLOCKS: usize = 128;

/// How many blocks of `class` a cache may hold (a table: a cache sets every class's limit
/// as its thread registers, and a division per class was most of that).
#[inline(always)]
pub(super) fn bin_limit(class: usize) -> u32 {
    BIN_LIMITS[class]
}

/// How many blocks of `class` a cache holds before its thread first allocates the class
/// (see [`freeing_limit_of`]).
#[inline(always)]
pub(super) fn freeing_limit(class: usize) -> u32 {
    FREEING_LIMITS[class]
}

/// `f(class)` for every class, computed at compile time.
macro_rules! class_table {
    ($f:ident) => {{
        let mut table = [0; CLASS_COUNT];
        let mut class = 0;
        while class < CLASS_COUNT {
            table[class] = $f(class);
            class += 1;
        }
        table
    }};
}

/// [`bin_limit`] of every class.
static BIN_LIMITS: [u32; CLASS_COUNT] = class_table!(bin_limit_of);
/// [`freeing_limit`] of every class.
static FREEING_LIMITS: [u32; CLASS_COUNT] = class_table!(freeing_limit_of);

/// [`bin_limit`], computed.
const fn bin_limit_of(class: usize) -> u32 {
    let n = BIN_BYTES / class_size(class);
    let n = if n < MIN_BIN_BLOCKS {
        MIN_BIN_BLOCKS
    } else {
        n
    };
    (if n > MAX_BIN_BLOCKS {
        MAX_BIN_BLOCKS
    } else {
        n
    }) as u32
}

/// How many blocks of `class` a cache holds before its thread first allocates the class:
/// a quarter of the limit. A thread that only frees a class (it collects what others
/// allocated) then keeps little of it from the threads that could reuse it.
const fn freeing_limit_of(class: usize) -> u32 {
    let n = bin_limit_of(class) / 4;
    if n < MIN_BIN_BLOCKS as u32 {
        MIN_BIN_BLOCKS as u32
    } else {
        n
    }
}

/// Blocks taken by the first refill of a bin, at most.
const FIRST_REFILL: u32 = 4;
/// Bytes the first refill of a bin takes at most (but one block): a refill links the slots
/// it takes through their first word, so each one it takes is memory made resident. A
/// thread, or a scoped tag, that uses a big class once holds one page of it, not four.
const FIRST_REFILL_BYTES: usize = 4096;

/// Blocks taken by the first refill of a bin of `class`.
const fn first_refill(class: usize) -> u32 {
    let n = FIRST_REFILL_BYTES / class_size(class);
    if n == 0 {
        1
    } else if n > FIRST_REFILL as usize {
        FIRST_REFILL
    } else {
        n as u32
    }
}

/// Every class's bin sizing before its first refill.
const fn first_sizings() -> [UnsafeCell<BinSizing>; CLASS_COUNT] {
    let mut sizings = [const {
        UnsafeCell::new(BinSizing {
            refill: FIRST_REFILL,
            limit: 0,
            seen: 0,
            sample_off: FAR,
            guard_off: FAR,
            budget_left: 0,
        })
    }; CLASS_COUNT];
    let mut class = 0;
    while class < CLASS_COUNT {
        sizings[class] = UnsafeCell::new(BinSizing {
            refill: first_refill(class),
            limit: 0,
            seen: 0,
            sample_off: FAR,
            guard_off: FAR,
            budget_left: 0,
        });
        class += 1;
    }
    sizings
}

/// [`Lane::free_gate`]: frees go straight into a bin (no records of this lane's blocks, no
/// guarded sampling).
const GATE_OPEN: u8 = 0;
/// Only sampled records: a free asks the sample filter first.
const GATE_SAMPLED: u8 = 1;
/// Records of every block or guarded sampling: a free asks the hooks, out of line.
const GATE_ASK: u8 = 2;

/// [`ClassSlot::open_until`] with records off.
pub(super) const OPEN: u64 = u64::MAX;
/// [`ClassSlot::open_until`] when the next allocation must take the miss path and look at
/// the hooks; while sampling, also "no countdown drawn for this class yet".
pub(super) const CLOSED: u64 = 0;

/// [`Lane::free_tag`] while frees must look at the hooks: a tag no segment has (the idle
/// lane's tag, `Tag::MAX`, is another).
pub(super) const ASK: Tag = Tag::MAX - 1;

/// The hooks a small free through lane 0 must look at (the others concern allocations).
const FREE_HOOKS: u8 = HOOK_FREE | HOOK_FREE_SAMPLED | HOOK_TAGS | HOOK_GUARD;
/// [`Lane::plain_from`] while records or sampling concern frees (no tags): no free is
/// plain; the hooks say what to ask. Above every address a block can have; its low 16 bits
/// are all ones (see [`THRESHOLD_LOW_BITS`]), so it is no route.
pub(crate) const PLAIN_NEVER: usize = usize::MAX >> 1;

/// The low 16 bits of every `plain_from` that is a threshold (an address below which frees
/// look at the hooks), not a route: bit 15 set tells a threshold from a route, and the 16
/// bits match no segment's tag, so the free's tag test fails for it without a test of its
/// own (see [`routed_lane_above_a_block`]). Setting them moves a threshold up by less than
/// 64 KiB, which only sends the blocks just above it to the hooks' exact tests.
const THRESHOLD_LOW_BITS: usize = 0xffff;

/// A threshold at `address` (see [`THRESHOLD_LOW_BITS`]).
const fn threshold_at(address: usize) -> usize {
    address | THRESHOLD_LOW_BITS
}

// A route is a lane's address shifted left with the tag its frees want in the bits below:
// a lane lives high in user space (thread-local storage, or memory mapped for it), so its
// shifted address is above every block (the free's plain test fails for every block), and
// the free compares the route's low 16 bits with a block's segment tag straight away.
const _: () = assert!(
    usize::BITS == 64,
    "a free route needs a lane's address shifted left by 15 to fit (a 64-bit target)"
);

/// Bits of a user-space address, of lanes and of blocks alike: user space on x86-64
/// (4-level paging, or 5-level without an address hint above 2^47) and on 48-bit aarch64
/// lies below 2^48.
const ROUTE_ADDRESS_BITS: u32 = 48;
/// Bits of the tag field, below the lane's address: 15, so that the route's top bit stays
/// clear. Every real tag fits (below `MAX_TAGS`), [`ASK`] and the idle lane's `Tag::MAX`
/// keep distinct values (0x7ffe, 0x7fff) that no segment has, and a guarded segment's tag
/// (0xfffd) is above every field.
const ROUTE_TAG_BITS: u32 = 63 - ROUTE_ADDRESS_BITS;
const ROUTE_TAG_MASK: usize = (1 << ROUTE_TAG_BITS) - 1;
/// The lowest lane address a route can name: shifted, it reaches 2^48, above every block.
/// Lanes lower than this (the main thread's thread-local storage in a static binary that is
/// not position-independent, or every thread under valgrind without `--aspace-minaddr`)
/// get a route *nowhere* instead (see [`ROUTE_NOWHERE`]).
const ROUTE_LOWEST_LANE: usize = 1 << (ROUTE_ADDRESS_BITS - ROUTE_TAG_BITS);
/// What a route to a lane too low to be named has set: the top bit (no route naming a lane
/// has it, as lanes lie below 2^48), which puts it above every block, and the whole tag
/// field (the idle lane's, which no segment has), with bit 15 clear as in every route. A
/// free that fails the tag test on it takes the miss path (never the hooks'), which finds
/// the block's tag itself: every small free of such a thread is slower, never wrong.
const ROUTE_NOWHERE: usize = 1 << 63 | ROUTE_TAG_MASK;
const _: () = assert!(crate::schema::hpha::MAX_TAGS <= (ASK as usize & ROUTE_TAG_MASK));
// The field's 16-bit view (what the free compares with a segment's tag) holds the lowest
// address bit above it, which is 0 for a lane: bit 15 of a route is clear, of a threshold set.
const _: () = assert!(align_of::<Lane>() >= 2);
const _: () = assert!(THRESHOLD_LOW_BITS & (1 << ROUTE_TAG_BITS) != 0);
const _: () = assert!(PLAIN_NEVER & THRESHOLD_LOW_BITS == THRESHOLD_LOW_BITS);

/// The [`Lane::plain_from`] that routes frees to `lane`, with the tag a block must have to
/// go into it (its [`free_tag`](Lane::free_tag) as of now; see [`routed_lane`]).
#[inline(always)]
fn route_to(lane: &Lane) -> *mut Lane {
    let address = ptr::from_ref(lane).addr();
    if address >> ROUTE_ADDRESS_BITS != 0 {
        route_out_of_reach(address);
    }
    let field = usize::from(lane.free_tag()) & ROUTE_TAG_MASK;
    // A lane too low to be named routes nowhere: without a branch, which kept `enter` and
    // `leave` small enough for the compiler to inline a guard's drop into its caller.
    let nowhere = usize::from(address < ROUTE_LOWEST_LANE).wrapping_neg() & ROUTE_NOWHERE;
    // The route word has no provenance of its own: [`routed_lane`] takes the lane's back
    // from this exposure (one instruction fewer than deriving it from the word).
    ptr::from_ref(lane).expose_provenance();
    ptr::without_provenance_mut(address << ROUTE_TAG_BITS | field | nowhere)
}

#[cold]
#[inline(never)]
fn route_out_of_reach(address: usize) -> ! {
    crate::fatal::fatal!(
        "a thread cache lane at {:#x}, above 2^48: the free route keeps a tag beside the \
         address (user space here reaches past 48 bits; tags need it below)",
        address
    )
}

/// The lane a [`Lane::plain_from`] routes frees to and the tag a block must have to be
/// pushed there, if it is a route naming a lane (not 0, a threshold, or [`ROUTE_NOWHERE`]).
#[inline(always)]
pub(crate) fn routed_lane(plain_from: *const Lane) -> Option<(*const Lane, Tag)> {
    if !is_routing(plain_from) || routes_nowhere(plain_from) {
        return None;
    }
    let word = plain_from.addr();
    Some((
        ptr::with_exposed_provenance(word >> ROUTE_TAG_BITS),
        (word & ROUTE_TAG_MASK) as Tag,
    ))
}

/// Whether a `plain_from` is a route to a lane too low to be named (see [`ROUTE_NOWHERE`]).
#[inline(always)]
pub(crate) fn routes_nowhere(plain_from: *const Lane) -> bool {
    plain_from.addr() & ROUTE_NOWHERE == ROUTE_NOWHERE
}

/// Whether a `plain_from` that a block's address is below (so not 0) is a route (bit 15
/// clear), rather than a threshold: what the free asks once its tag test failed.
#[inline(always)]
pub(crate) fn is_route(plain_from: *const Lane) -> bool {
    plain_from.addr() & (1 << ROUTE_TAG_BITS) == 0
}

/// Whether a `plain_from` is a route, [`ROUTE_NOWHERE`] included: lane 0 routes frees
/// (tags are in use), and its owner keeps the route on the lane it is in.
#[inline(always)]
fn is_routing(plain_from: *const Lane) -> bool {
    !plain_from.is_null() && is_route(plain_from)
}

/// The free's fast way with a `plain_from` that a block's address is below (the plain test
/// failed): if the word's low 16 bits equal `segment_tag`, the block's segment tag, the word
/// is a route (no threshold's low bits are a tag, nor [`ROUTE_NOWHERE`]'s) to the lane that
/// takes the block, one shift away. No test of the word's kind before the tag test, and no
/// load of the lane's `free_tag` (that load was about 4% of a scoped alloc+free pair).
#[inline(always)]
pub(crate) fn routed_lane_above_a_block(
    plain_from: *const Lane,
    segment_tag: Tag,
) -> Option<*const Lane> {
    let word = plain_from.addr();
    if word as Tag != segment_tag {
        return None;
    }
    Some(ptr::with_exposed_provenance(word >> ROUTE_TAG_BITS))
}

/// A size class as the global allocator's fast paths index a lane: the class times the
/// length of a [`ClassSlot`] in words, so that a slot's address is the lane's plus the key
/// scaled by 8 (one addressing mode), where a class needs a multiply first (an instruction
/// on each of the pair's two fast paths). The class itself is recovered only off them.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) struct ClassKey(usize);

impl ClassKey {
    const WORDS: usize = size_of::<ClassSlot>() / 8;

    /// The key of `class`.
    #[inline(always)]
    pub(crate) const fn of(class: usize) -> Self {
        Self(class * Self::WORDS)
    }

    /// The class of this key.
    #[inline(always)]
    pub(crate) const fn class(self) -> usize {
        self.0 / Self::WORDS
    }
}

const _: () = assert!(size_of::<ClassSlot>() % 8 == 0 && align_of::<ClassSlot>() == 8);

/// [`ClassKey`] of every size in 8-byte units, as [`CLASS_BY_UNITS`] gives its class (a
/// `const` reference for the same reason: a compile-time layout's key folds to a constant).
const KEY_BY_UNITS: &[u16; MAX_SMALL / 8 + 1] = &{
    let mut table = [0u16; MAX_SMALL / 8 + 1];
    let mut units = 0;
    while units <= MAX_SMALL / 8 {
        table[units] = ClassKey::of(CLASS_BY_UNITS[units] as usize).0 as u16;
        units += 1;
    }
    table
};
const _: () = assert!(ClassKey::of(CLASS_COUNT).0 <= u16::MAX as usize);

/// `fast_class` (see `size_class`) as a [`ClassKey`]: the same row, the key looked up in
/// place of the class.
#[inline(always)]
pub(crate) fn fast_key(layout: Layout) -> Option<ClassKey> {
    fast_units(layout).map(|units| ClassKey(KEY_BY_UNITS[units] as usize))
}

/// One size class's cached blocks.
#[derive(Clone, Copy)]
pub(super) struct Bin {
    pub(super) head: *mut FreeSlot,
    /// Where the class's net frees (`frees - allocations`, the counters the statistics
    /// read) reach a full bin: the bin's count is that net minus `full_at - limit`. The
    /// count is frees into the bin minus blocks taken from it since the last refill: a
    /// refill may hand over a page's whole free list, which is not counted (so a thread
    /// that mostly allocates never walks those cold blocks), and taking them may drive it
    /// below zero. It never exceeds the list's length, and is reset to 0 at each refill
    /// (the list is empty then), so the bin holds at most `limit` plus one refill. Kept
    /// this way, the fast paths update only the statistics' counters, never a second one.
    pub(super) full_at: i64,
}

/// How big one size class's bin may grow; only the slow paths read it, so it lives apart
/// from the [`Bin`] (which keeps a class's fast-path slot at 40 bytes).
pub(super) struct BinSizing {
    /// Blocks to take at the next refill: starts small so a short-lived thread that uses a
    /// class once does not take (and later give back) a whole batch, and doubles with use
    /// up to half the limit.
    pub(super) refill: u32,
    /// 0 until the cache is registered and again once it is dead, so that the first free
    /// of a new cache, and every free of a dead one, takes the slow path.
    pub(super) limit: i32,
    /// Child lanes: the class's unpublished blocks as the owner last saw them on a slow
    /// path (see [`Lane::note_unpublished`]).
    seen: i32,
    /// While guarded sampling is on (`HOOK_GUARD`): where the class's next sampled and
    /// next guarded allocations fall, as distances past the class's mark (one of them is
    /// 0: the mark is the nearer), or [`FAR`] (not drawn, or farther than a `u32` reaches:
    /// drawn afresh on arrival, which the memoryless countdowns allow). See
    /// `ThreadCache::charge_guarded`.
    pub(super) sample_off: u32,
    pub(super) guard_off: u32,
    /// While the lane is open under a budget (`HOOK_BUDGET`): allocations of the class
    /// that may go through before the next checkpoint (see `lanes::checkpoint_decide`).
    /// Left as it was when the gate changes: it is never more than one checkpoint's run,
    /// which the budget's margin covers.
    pub(super) budget_left: u32,
}

/// [`BinSizing::sample_off`] and [`BinSizing::guard_off`]: nothing drawn within reach.
pub(super) const FAR: u32 = u32::MAX;

/// Whether `bin`, of the class whose slot is `slot` and whose free count is `frees`, holds
/// its limit: net frees (`frees - allocations`) at or past [`Bin::full_at`]. Written as
/// `frees >= allocations + full_at` so that a caller that goes on to store `frees + 1` keeps
/// `frees` in its register (the counts never reach 2^63, so the two forms agree).
#[inline(always)]
fn full_with(slot: &ClassSlot, bin: &Bin, frees: u64) -> bool {
    frees as i64 >= (slot.allocations.load(Relaxed) as i64).wrapping_add(bin.full_at)
}

/// One size class of a lane: its bin (owner-only) and its counts (owner writes, anyone
/// reads), side by side so the fast path touches one cache line.
pub(super) struct ClassSlot {
    bin: UnsafeCell<Bin>,
    pub(super) allocations: AtomicU64,
    pub(super) frees: AtomicU64,
    /// The fast path serves an allocation only while `allocations` is below this: [`OPEN`]
    /// with records off, [`CLOSED`] when every allocation must step aside (records of every
    /// allocation, a cache not registered, a settings change not yet seen by the owner, a
    /// child lane that is closed), and while sampling the count at which the class's next
    /// sampled allocation falls. In lane 0 the owner writes it on its miss path and a thread
    /// changing the records settings closes it; in a child lane only the thread changing the
    /// lane's gate writes it (see `crate::allocator::lanes`).
    pub(super) open_until: AtomicU64,
}

/// A thread cache's bins and counts for one allocator: lane 0 for the `SystemAllocator`,
/// the others for children that own them (one per tag, see `crate::allocator::lanes`).
/// Cache-line aligned, so that every lane's class slots fall on cache lines the way lane
/// 0's do (a child lane 16 bytes off cost the `small` workload through a child about 10% of
/// its time).
#[repr(align(64))]
pub(crate) struct Lane {
    /// In lane 0, what the `SystemAllocator`'s records ask of this thread's fast paths
    /// (`HOOK_*` in the parent module): a mirror of its settings word, written under the
    /// registry lock by whoever changes the word and read by the owner with one load from
    /// its own TLS (no static to reach, no shared line). 0: records off, nothing to do.
    /// In a child lane, 0 while the lane is open and `HOOK_FREE` while it is closed (frees
    /// then leave the fast path too). Lane 0 also has `HOOK_TAGS` once a scoped tag was
    /// entered anywhere: a block freed through the global allocator may then be a tag's.
    pub(super) hooks: AtomicU8,
    /// The tag whose blocks the bins hold (0: the `SystemAllocator`'s). Set when the lane is
    /// set up, under the thread registry's lock.
    pub(super) tag: AtomicU16,
    /// [`tag`](Self::tag) while the hooks let a free straight into a bin (no `HOOK_FREE`, no
    /// `HOOK_FREE_SAMPLED`), else [`ASK`]: the global allocator's scoped free compares a
    /// block's segment tag with a copy of it in the free route (see
    /// [`route_frees_to`](Self::route_frees_to), which keeps the copy current). Written with
    /// the hooks (see [`set_hooks`](Self::set_hooks)).
    free_tag: AtomicU16,
    /// What a free through this lane must ask (one of the `GATE_*` values), derived from the
    /// hooks: [`free_filtered`](Self::free_filtered) reads this one byte with a single
    /// compare, so that a lane that only samples pays the sample filter's test and nothing
    /// more. Written with the hooks (see [`set_hooks`](Self::set_hooks)).
    free_gate: AtomicU8,
    /// Child lanes open under a budget: set by the owner while it counts an allocation
    /// (from just before it looks at the gate again until the count is stored), so that a
    /// thread deciding at the budget's limit waits for a block the lane is taking as its
    /// gate closes (see [`announce_budget_allocation`](Self::announce_budget_allocation)).
    budget_in_flight: AtomicBool,
    /// Lane 0: a global small free of a block at or above this address goes straight into
    /// a bin without reading the hooks (one compare, see `free_gated`): 0 while no hook
    /// concerns frees, the end of the guarded area (as a threshold: [`threshold_at`]) while
    /// guarded sampling is the only one (the area lies low in the address space, so
    /// ordinary blocks are above it),
    /// once tags are in use a route (see [`routed_lane`]) to the lane of the tag the thread is in,
    /// with that lane's free tag (so the scoped free needs no look at the hooks, nor at
    /// `ThreadCache::current`, nor at the lane's `free_tag`), and
    /// [`PLAIN_NEVER`] otherwise. Written with the hooks (see [`set_hooks`](Self::set_hooks)),
    /// and the route by the owner as it enters and leaves scopes (see
    /// [`route_frees_to`](Self::route_frees_to)). A pointer for the route's provenance.
    plain_from: AtomicPtr<Lane>,
    /// The small heap of that tag, where refills come from and overflows go (null: tag 0's).
    heap: AtomicPtr<SmallHeap>,
    /// The next lane made on demand for the same thread (see `ThreadCache::dynamic`).
    pub(super) next: AtomicPtr<Lane>,
    /// Child lanes: the requested bytes of blocks allocated through this lane on this
    /// thread, and of those freed (owner-written, wrapping; live = allocated - freed). Two
    /// running totals, not one net figure, so that an allocation's add and the next free's
    /// subtract do not wait on each other through one memory cell (a store-forwarding
    /// chain that cost a pair loop about 8% of its time).
    requested_in: AtomicUsize,
    requested_out: AtomicUsize,
    pub(super) slots: [ClassSlot; CLASS_COUNT],
    /// Owner only.
    sizing: [UnsafeCell<BinSizing>; CLASS_COUNT],
    /// Child lanes: per class, the net allocations (allocations minus frees, low 32 bits)
    /// whose granted bytes are already in the owners' shared live figures. Advanced by
    /// compare-and-swap, by the owner on its slow paths or by another thread that needs
    /// the exact figure (see `crate::allocator::lanes`).
    pub(super) published: [AtomicU32; CLASS_COUNT],
    /// Child lanes, owner only: the unpublished bytes of every class, summed as the owner
    /// last saw each on a slow path (see [`Lane::note_unpublished`]).
    pending: UnsafeCell<isize>,
    /// Child lanes: resizes of small blocks kept in the lane (owner-written; see
    /// [`Lane::count_resize`]).
    resizes: AtomicU64,
    /// Child lanes: of those, the ones that moved the block to another class: each is also
    /// one allocation and one free in the per-class counts, which the totals take back out
    /// (a resize is not an allocation). Owner-written.
    moves: AtomicU64,
}

impl Lane {
    pub(super) const fn new(hooks: u8) -> Self {
        Self::with_tag(hooks, 0)
    }

    /// A lane that serves nothing (see `ThreadCache::current`): closed, empty, and of a tag
    /// no segment has, so no free is ever pushed into it.
    pub(super) const fn idle() -> Self {
        Self::with_tag(super::HOOKS_UNREGISTERED, Tag::MAX)
    }

    const fn with_tag(hooks: u8, tag: Tag) -> Self {
        Self {
            hooks: AtomicU8::new(hooks),
            tag: AtomicU16::new(tag),
            free_tag: AtomicU16::new(Self::free_tag_for(hooks, tag)),
            free_gate: AtomicU8::new(Self::free_gate_for(hooks)),
            budget_in_flight: AtomicBool::new(false),
            // A route needs the lane's address: set by `set_hooks` (no lane is made with
            // `HOOK_TAGS`).
            plain_from: AtomicPtr::new(ptr::without_provenance_mut(match hooks & FREE_HOOKS {
                0 => 0,
                _ => PLAIN_NEVER,
            })),
            heap: AtomicPtr::new(null_mut()),
            next: AtomicPtr::new(null_mut()),
            requested_in: AtomicUsize::new(0),
            requested_out: AtomicUsize::new(0),
            slots: [const {
                ClassSlot {
                    bin: UnsafeCell::new(Bin {
                        head: null_mut(),
                        full_at: 0,
                    }),
                    allocations: AtomicU64::new(0),
                    frees: AtomicU64::new(0),
                    open_until: AtomicU64::new(CLOSED),
                }
            }; CLASS_COUNT],
            sizing: first_sizings(),
            published: [const { AtomicU32::new(0) }; CLASS_COUNT],
            pending: UnsafeCell::new(0),
            resizes: AtomicU64::new(0),
            moves: AtomicU64::new(0),
        }
    }

    /// The hooks byte (see the field).
    #[inline(always)]
    pub(crate) fn hooks(&self) -> u8 {
        self.hooks.load(Relaxed)
    }

    /// The tag whose blocks this lane holds.
    #[inline(always)]
    pub(crate) fn tag(&self) -> Tag {
        self.tag.load(Relaxed)
    }

    /// [`free_tag`](Self::free_tag) for `hooks` and `tag`.
    const fn free_tag_for(hooks: u8, tag: Tag) -> Tag {
        if hooks & (HOOK_FREE | HOOK_FREE_SAMPLED) != 0 {
            ASK
        } else {
            tag
        }
    }

    /// [`plain_from`](Self::plain_from) for `hooks`, or `None` to leave it as it is: with
    /// [`HOOK_TAGS`] the owner keeps it routed to its current lane, and only the first
    /// setting (before any thread can be in a scope: see `enable_tags`) routes it here.
    fn plain_from_for(&self, hooks: u8) -> Option<*mut Lane> {
        let address = match hooks & FREE_HOOKS {
            0 => 0,
            HOOK_GUARD => threshold_at(guarded::AREA.end()),
            _ if hooks & HOOK_TAGS != 0 => {
                return (!is_routing(self.plain_from())).then(|| route_to(self));
            }
            _ => PLAIN_NEVER,
        };
        Some(ptr::without_provenance_mut(address))
    }

    /// Lane 0 of a thread in a scope or out of one: routes the global allocator's small frees
    /// to `current`, if tags are in use (else the hooks decide as before). By the owner,
    /// the only writer of a route to a new lane (see [`plain_from_for`](Self::plain_from_for)).
    ///
    /// The route carries `current`'s [`free_tag`](Self::free_tag), which a thread changing
    /// records may change meanwhile: the owner stores the route, then reads the tag again,
    /// and the changer ([`refresh_route`](Self::refresh_route)) stores the tag, then reads
    /// the route, with a full barrier between on each side (here a compiler fence where the
    /// changer's `membarrier` serves as the hardware one, else a fence), so at least one of
    /// them sees the other's store and the route never keeps a tag that lets a free skip
    /// the records.
    #[inline(always)]
    pub(super) fn route_frees_to(&self, current: &Lane) {
        if !is_routing(self.plain_from()) {
            return;
        }
        loop {
            let route = route_to(current);
            self.plain_from.store(route, Relaxed);
            if crate::sync::process_barrier_ready() {
                compiler_fence(SeqCst);
            } else {
                fence(SeqCst);
            }
            if route_to(current).addr() == route.addr() {
                return;
            }
        }
    }

    /// Lane 0 of another thread, by a thread that changed lanes' [`free_tag`](Self::free_tag)
    /// under the registry lock and then called `sync::process_barrier`: brings the tag in the
    /// route up to date with the routed lane's (see [`route_frees_to`](Self::route_frees_to)).
    /// A compare-and-swap, so that a route the owner just moved to another lane is left alone.
    pub(super) fn refresh_route(&self) {
        let mut seen = self.plain_from.load(Relaxed);
        while let Some((lane, _)) = routed_lane(seen) {
            // SAFETY: a route names one of the owner's lanes (valid while its cache is
            // registered, which the caller's lock keeps so) or the idle lane (static).
            let want = route_to(unsafe { &*lane });
            if want.addr() == seen.addr() {
                return;
            }
            match self
                .plain_from
                .compare_exchange(seen, want, Relaxed, Relaxed)
            {
                Ok(_) => return,
                Err(now) => seen = now,
            }
        }
    }

    /// Lane 0: the lowest address of a block whose free needs no look at the hooks, or a
    /// route (see the field).
    #[inline(always)]
    pub(super) fn plain_from(&self) -> *const Lane {
        self.plain_from.load(Relaxed)
    }

    /// [`free_gate`](Self::free_gate) for `hooks`.
    const fn free_gate_for(hooks: u8) -> u8 {
        match hooks & (HOOK_FREE | HOOK_FREE_SAMPLED | HOOK_GUARD) {
            0 => GATE_OPEN,
            HOOK_FREE_SAMPLED => GATE_SAMPLED,
            _ => GATE_ASK,
        }
    }

    /// The tag a block must have to be freed straight into a bin here (see the field).
    #[inline(always)]
    pub(super) fn free_tag(&self) -> Tag {
        self.free_tag.load(Relaxed)
    }

    /// Sets the hooks byte (and with it [`free_tag`](Self::free_tag)): by whoever owns the
    /// lane's settings (the owner setting it up, or a thread changing them under the thread
    /// registry's lock), before the marks that tell the owner to look.
    ///
    /// Returns whether the [`free_tag`](Self::free_tag) changed: then routes to this lane
    /// need [`refresh_route`](Self::refresh_route) (unless the owner is the caller).
    pub(super) fn set_hooks(&self, hooks: u8) -> bool {
        let free_tag = Self::free_tag_for(hooks, self.tag());
        let changed = self.free_tag.swap(free_tag, Relaxed) != free_tag;
        self.free_gate.store(Self::free_gate_for(hooks), Relaxed);
        if let Some(plain_from) = self.plain_from_for(hooks) {
            self.plain_from.store(plain_from, Relaxed);
        }
        self.hooks.store(hooks, Relaxed);
        changed
    }

    /// Adds `more` to the hooks byte (with what follows from it), under the thread
    /// registry's lock.
    pub(super) fn add_hooks(&self, more: u8) {
        self.set_hooks(self.hooks.load(Relaxed) | more);
    }

    /// Makes this lane the one of `tag`, whose small heap is `heap` (the owner, setting the
    /// lane up while its bins are empty).
    pub(super) fn set_tag(&self, tag: Tag, heap: &SmallHeap) {
        self.tag.store(tag, Relaxed);
        self.set_hooks(self.hooks.load(Relaxed));
        let heap = if tag == 0 {
            null_mut()
        } else {
            ptr::from_ref(heap).cast_mut()
        };
        self.heap.store(heap, Relaxed);
    }

    /// The small heap this lane's blocks come from and go back to.
    #[inline(always)]
    pub(super) fn heap(&self) -> &'static SmallHeap {
        let heap = self.heap.load(Relaxed);
        if heap.is_null() {
            return HEAP.small_heap();
        }
        // SAFETY: set from a `&SmallHeap` of the process-wide heap, whose tagged heaps live
        // as long as the process.
        unsafe { &*heap }
    }

    /// The class slot of `key`.
    ///
    /// # Safety
    /// `key` is the key of a class (`< CLASS_COUNT`).
    #[inline(always)]
    unsafe fn slot_at(&self, key: ClassKey) -> &ClassSlot {
        // SAFETY: the key of a class below `CLASS_COUNT` is that class's slot's offset in
        // words (`ClassKey::of`), so this is `&self.slots[class]`.
        unsafe {
            &*self
                .slots
                .as_ptr()
                .cast::<u64>()
                .add(key.0)
                .cast::<ClassSlot>()
        }
    }

    /// The bin of `class`.
    ///
    /// # Safety
    /// Only the owning thread (or a forked child that adopted the cache) may call this, and
    /// not while another reference to the bin is live; `class < CLASS_COUNT`.
    #[inline(always)]
    #[allow(clippy::mut_from_ref)]
    pub(super) unsafe fn bin(&self, class: usize) -> &mut Bin {
        // SAFETY: forwarded from the caller; the `&mut` covers only the bin, never the
        // counters other threads read.
        unsafe { &mut *self.slots.get_unchecked(class).bin.get() }
    }

    /// The sizing of the bin of `class`.
    ///
    /// # Safety
    /// As for [`bin`](Self::bin).
    #[inline(always)]
    #[allow(clippy::mut_from_ref)]
    pub(super) unsafe fn sizing(&self, class: usize) -> &mut BinSizing {
        // SAFETY: forwarded from the caller.
        unsafe { &mut *self.sizing.get_unchecked(class).get() }
    }

    /// Counts an allocation; only the owning thread writes, so a load and a store suffice.
    ///
    /// # Safety
    /// `class < CLASS_COUNT`.
    #[inline(always)]
    pub(super) unsafe fn owner_alloc(&self, class: usize) {
        // SAFETY: forwarded from the caller.
        counts::owner_add(unsafe { &self.slots.get_unchecked(class).allocations });
    }

    /// Counts a free, as [`owner_alloc`](Self::owner_alloc).
    ///
    /// # Safety
    /// `class < CLASS_COUNT`.
    #[inline(always)]
    pub(super) unsafe fn owner_free(&self, class: usize) {
        // SAFETY: forwarded from the caller.
        counts::owner_add(unsafe { &self.slots.get_unchecked(class).frees });
    }

    /// Takes back one allocation and one free of `class` (a block a budget's checkpoint
    /// took and gave back: no call of the program's). The net stays, so the bin's count and
    /// the publication marks do too.
    ///
    /// # Safety
    /// Owning thread; `class < CLASS_COUNT`; both were just counted here.
    pub(super) unsafe fn forget_pair(&self, class: usize) {
        // SAFETY: forwarded from the caller.
        let slot = unsafe { self.slots.get_unchecked(class) };
        slot.allocations
            .store(slot.allocations.load(Relaxed) - 1, Relaxed);
        slot.frees.store(slot.frees.load(Relaxed) - 1, Relaxed);
    }

    /// The class's net frees on this thread (frees minus allocations, wrapping).
    #[inline(always)]
    pub(super) fn net_frees(&self, class: usize) -> i64 {
        // SAFETY: callers pass `class < CLASS_COUNT`.
        let slot = unsafe { self.slots.get_unchecked(class) };
        counts::net_frees(&slot.allocations, &slot.frees)
    }

    /// Whether the bin of `class` holds its limit (see [`Bin::full_at`]).
    ///
    /// # Safety
    /// Owning thread; `class < CLASS_COUNT`.
    #[inline(always)]
    pub(super) unsafe fn bin_full(&self, class: usize) -> bool {
        // SAFETY: forwarded from the caller.
        unsafe {
            let slot = self.slots.get_unchecked(class);
            full_with(slot, &*slot.bin.get(), slot.frees.load(Relaxed))
        }
    }

    /// The bin's count (see [`Bin::full_at`]).
    ///
    /// # Safety
    /// Owning thread; `class < CLASS_COUNT`.
    pub(super) unsafe fn count(&self, class: usize) -> i32 {
        // SAFETY: forwarded from the caller.
        let (bin, limit) = unsafe { (self.bin(class), self.sizing(class).limit) };
        (self.net_frees(class) - (bin.full_at - i64::from(limit))) as i32
    }

    /// Sets the bin's count (its limit stays).
    ///
    /// # Safety
    /// Owning thread; `class < CLASS_COUNT`.
    pub(super) unsafe fn set_count(&self, class: usize, count: i32) {
        let net = self.net_frees(class);
        // SAFETY: forwarded from the caller.
        let (bin, limit) = unsafe { (self.bin(class), self.sizing(class).limit) };
        bin.full_at = net - i64::from(count) + i64::from(limit);
    }

    /// Sets the bin's limit, its count staying.
    ///
    /// # Safety
    /// Owning thread; `class < CLASS_COUNT`.
    pub(super) unsafe fn set_limit(&self, class: usize, limit: i32) {
        // SAFETY: forwarded from the caller.
        unsafe {
            let count = self.count(class);
            self.sizing(class).limit = limit;
            self.set_count(class, count);
        }
    }

    /// Pops a block of `key`'s class if the bin has one and the class's allocation count is
    /// below its [`open_until`](ClassSlot::open_until) mark; null otherwise.
    ///
    /// # Safety
    /// Owning thread; `key` is the key of a class (`< CLASS_COUNT`).
    #[inline(always)]
    pub(super) unsafe fn allocate_open(&self, key: ClassKey) -> *mut u8 {
        // SAFETY: forwarded from the caller.
        unsafe {
            let class_slot = self.slot_at(key);
            let bin = &mut *class_slot.bin.get();
            let slot = bin.head;
            let count = class_slot.allocations.load(Relaxed);
            if slot.is_null() || count >= class_slot.open_until.load(Relaxed) {
                return null_mut();
            }
            let next = (*slot).next;
            bin.head = next;
            prefetch_head(next);
            class_slot.allocations.store(count + 1, Relaxed);
            mark_allocated(slot.cast());
            slot.cast()
        }
    }

    /// Takes `slot`, the head of `bin`, for the program.
    ///
    /// # Safety
    /// `bin` is this lane's bin of `class` and `slot` its non-null head.
    #[inline(always)]
    pub(super) unsafe fn pop(&self, bin: &mut Bin, slot: *mut FreeSlot, class: usize) -> *mut u8 {
        // SAFETY: forwarded from the caller: `slot` is a free block linked in the bin.
        unsafe {
            let next = (*slot).next;
            bin.head = next;
            prefetch_head(next);
            self.owner_alloc(class);
            mark_allocated(slot.cast());
        }
        slot.cast()
    }

    /// Counts in the lane a block of `class` taken with [`pop_uncounted`](Self::pop_uncounted)
    /// (or an uncounted refill): one allocation more, and the bin's count as a counted pop
    /// leaves it (the uncounted one already took the block off it).
    ///
    /// # Safety
    /// Owning thread; `class < CLASS_COUNT`; no other reference to the bin is live.
    #[inline(always)]
    pub(super) unsafe fn count_uncounted_pop(&self, class: usize) {
        // SAFETY: forwarded from the caller.
        unsafe {
            self.bin(class).full_at -= 1;
            self.owner_alloc(class);
        }
    }

    /// Takes `slot`, the head of `bin`, for a caller that counts it elsewhere: the lane's
    /// counts stay, the bin's count drops by one (see [`Bin::full_at`]).
    ///
    /// # Safety
    /// As for [`pop`](Self::pop).
    #[inline(always)]
    pub(super) unsafe fn pop_uncounted(&self, bin: &mut Bin, slot: *mut FreeSlot) -> *mut u8 {
        // SAFETY: forwarded from the caller: `slot` is a free block linked in the bin.
        unsafe {
            bin.head = (*slot).next;
            bin.full_at += 1;
            mark_allocated(slot.cast());
        }
        slot.cast()
    }

    /// Puts the block at `ptr` at the head of `bin` for a caller that counts the free
    /// elsewhere: the lane's counts stay, the bin's count grows by one.
    ///
    /// # Safety
    /// `bin` is this lane's bin of `class`, with room; `ptr` is a live small block of
    /// `class`, which becomes free.
    #[inline(always)]
    pub(super) unsafe fn push_uncounted(&self, bin: &mut Bin, ptr: *mut u8, class: usize) {
        // SAFETY: forwarded from the caller.
        unsafe {
            check_free(ptr, class);
            let slot: *mut FreeSlot = ptr.cast();
            (*slot).next = bin.head;
            bin.head = slot;
            bin.full_at -= 1;
        }
    }

    /// Puts the block at `ptr` at the head of its bin unless the bin holds its limit
    /// (`false` then), and counts the free. The test of [`bin_full`](Self::bin_full) with
    /// the class's free count loaded once, for both the test and the count: one load fewer
    /// than testing and counting apart, which a memory-bound loop feels (the untagged
    /// `churn` ran about 6% faster).
    ///
    /// # Safety
    /// Owning thread; `key` is the key of a class (`< CLASS_COUNT`); `ptr` is a live small
    /// block of that class in a segment of this lane's tag.
    #[inline(always)]
    pub(super) unsafe fn push_if_room(&self, ptr: *mut u8, key: ClassKey) -> bool {
        // SAFETY: forwarded from the caller.
        unsafe {
            let slot = self.slot_at(key);
            let frees = slot.frees.load(Relaxed);
            let bin = &mut *slot.bin.get();
            if full_with(slot, bin, frees) {
                return false;
            }
            check_free(ptr, key.class());
            let free: *mut FreeSlot = ptr.cast();
            (*free).next = bin.head;
            bin.head = free;
            slot.frees.store(frees + 1, Relaxed);
        }
        true
    }

    /// Pushes a block of `class` if the bin has room and the lane's hooks let it: records
    /// are off (lane 0), or only sample and the sample filter rules the block out (lane
    /// 0), or the lane is open (a child lane). Lane 0's `HOOK_TAGS` is not asked: the caller
    /// knows the block is of this lane's tag.
    ///
    /// # Safety
    /// Owning thread; `ptr` is a live small block of `class` in a segment of this lane's tag.
    #[inline(always)]
    pub(super) unsafe fn free_filtered(&self, ptr: *mut u8, class: usize) -> bool {
        // SAFETY: forwarded from the caller.
        unsafe {
            // One compare of the gate byte (above, below or at GATE_SAMPLED), so records off
            // pays one load and two branches, and sampling alone the filter's test on top.
            let gate = self.free_gate.load(Relaxed);
            if gate > GATE_SAMPLED {
                // Out of the straight line: records off is the case to keep short.
                cold_path();
                let hooks = self.hooks.load(Relaxed);
                if hooks & HOOK_FREE != 0
                    || (hooks & HOOK_GUARD != 0 && guarded::AREA.contains(ptr.addr()))
                    || (hooks & HOOK_FREE_SAMPLED != 0 && records::global::maybe_sampled(ptr))
                {
                    return false;
                }
            } else if gate == GATE_SAMPLED && records::global::maybe_sampled(ptr) {
                return false;
            }
            self.push_if_room(ptr, ClassKey::of(class))
        }
    }

    /// Gives every cached block back to the heap; the bins stay usable.
    ///
    /// # Safety
    /// Only the owning thread (or a forked child adopting the cache) may call this.
    pub(super) unsafe fn flush(&self) {
        for class in 0..CLASS_COUNT {
            // SAFETY: forwarded; the cached slots are free blocks of this class.
            unsafe {
                let bin = self.bin(class);
                let mut len = 0;
                let mut slot = bin.head;
                while !slot.is_null() {
                    len += 1;
                    slot = (*slot).next;
                }
                if len > 0 {
                    self.heap().return_slots(class, bin.head, len, HEAP.stamp());
                }
                bin.head = null_mut();
                self.set_count(class, 0);
            }
        }
    }

    /// Limit 0 and a full bin in every class (the bins must be empty): every later free
    /// takes the slow path.
    ///
    /// # Safety
    /// Only the owning thread (or a forked child adopting the cache) may call this, after
    /// [`flush`](Self::flush) and with the counts at zero.
    pub(super) unsafe fn shut(&self) {
        for (class, slot) in self.slots.iter().enumerate() {
            slot.open_until.store(CLOSED, Relaxed);
            // SAFETY: forwarded from the caller.
            unsafe {
                self.sizing(class).limit = 0;
                self.bin(class).full_at = 0;
            }
        }
    }

    /// The class's blocks allocated on this thread and not yet published (negative when
    /// more were freed; see `counts::unpublished`).
    fn unpublished_blocks(&self, class: usize) -> i32 {
        let slot = &self.slots[class];
        counts::unpublished(&self.published[class], &slot.allocations, &slot.frees)
    }

    /// The granted bytes of `blocks` blocks of `class` (wrapping: negative stays negative).
    fn bytes_of(class: usize, blocks: i32) -> usize {
        (blocks as isize * CLASS_SIZES[class] as isize) as usize
    }

    /// This lane's granted bytes on this thread not yet published, summed over the classes
    /// (wrapping: negative when more was freed here than allocated).
    pub(crate) fn unpublished_bytes(&self) -> usize {
        (0..CLASS_COUNT).fold(0usize, |bytes, class| {
            bytes.wrapping_add(Self::bytes_of(class, self.unpublished_blocks(class)))
        })
    }

    /// [`take_unpublished`](Self::take_unpublished) when no other thread can publish the
    /// lane: its owner is exiting and holds the registry lock, which every other publisher
    /// of another thread's lane holds too (see `counts::take_unpublished_exiting`).
    pub(crate) fn take_unpublished_exiting(&self, class: usize) -> usize {
        let slot = &self.slots[class];
        let blocks = counts::take_unpublished_exiting(
            &self.published[class],
            &slot.allocations,
            &slot.frees,
        );
        Self::bytes_of(class, blocks)
    }

    /// Marks the net allocations of `class` as published; returns the granted bytes that
    /// were not yet (wrapping). Any thread: `published` advances by compare-and-swap, so
    /// every block's bytes are published exactly once (see `counts::take_unpublished`).
    pub(crate) fn take_unpublished(&self, class: usize) -> usize {
        let slot = &self.slots[class];
        let blocks =
            counts::take_unpublished(&self.published[class], &slot.allocations, &slot.frees);
        Self::bytes_of(class, blocks)
    }

    /// On a slow path of the owner's: updates the lane's pending total with what `class`
    /// has unpublished now, and returns the total (wrapping). Plain loads and stores, no
    /// read-modify-write: the owner publishes (with [`take_unpublished`](Self::take_unpublished))
    /// only once the total passes a threshold, then calls [`published_all`](Self::published_all).
    ///
    /// # Safety
    /// Owning thread; `class < CLASS_COUNT`.
    pub(super) unsafe fn note_unpublished(&self, class: usize) -> isize {
        let blocks = self.unpublished_blocks(class);
        // SAFETY: forwarded from the caller: the sizing and the total are the owner's.
        unsafe {
            let sizing = self.sizing(class);
            let change = Self::bytes_of(class, blocks.wrapping_sub(sizing.seen)) as isize;
            sizing.seen = blocks;
            let pending = &mut *self.pending.get();
            *pending = pending.wrapping_add(change);
            *pending
        }
    }

    /// After the owner published every class: the pending total starts again.
    ///
    /// # Safety
    /// Owning thread.
    pub(super) unsafe fn published_all(&self) {
        // SAFETY: forwarded from the caller.
        unsafe {
            for class in 0..CLASS_COUNT {
                self.sizing(class).seen = 0;
            }
            *self.pending.get() = 0;
        }
    }

    /// Adds this lane's figures on this thread to `sum` (any thread), as a shard adds its
    /// own: unpublished granted bytes, requested bytes, allocations and frees.
    pub(crate) fn add_to(&self, sum: &mut ShardSum) {
        sum.unpublished = sum.unpublished.wrapping_add(self.unpublished_bytes());
        let freed = self.requested_out.load(Relaxed);
        let allocated = self.requested_in.load(Relaxed);
        sum.requested = sum.requested.wrapping_add(allocated.wrapping_sub(freed));
        // Frees before allocations, so a pair made between the reads never counts as a
        // negative live block.
        for slot in &self.slots {
            sum.frees = sum.frees.wrapping_add(slot.frees.load(Relaxed));
        }
        for slot in &self.slots {
            sum.allocations = sum.allocations.wrapping_add(slot.allocations.load(Relaxed));
        }
        let moves = self.moves.load(Relaxed);
        sum.allocations = sum.allocations.wrapping_sub(moves);
        sum.frees = sum.frees.wrapping_sub(moves);
        sum.reallocations = sum.reallocations.wrapping_add(self.resizes.load(Relaxed));
    }

    /// Counts a resize of a small block that stays in this lane (owner only): in place
    /// (`moved == false`: the requested bytes change from `old_size` to `new_size`), or
    /// into another class (the allocation and free that moved it were counted already).
    #[inline(always)]
    pub(crate) fn count_resize(&self, old_size: usize, new_size: usize, moved: bool) {
        if moved {
            self.moves.store(self.moves.load(Relaxed) + 1, Relaxed);
        } else {
            self.add_requested(new_size);
            self.sub_requested(old_size);
        }
        self.resizes.store(self.resizes.load(Relaxed) + 1, Relaxed);
    }

    /// Counts `size` requested bytes of a block the owner just took from this lane.
    #[inline(always)]
    pub(super) fn add_requested(&self, size: usize) {
        self.requested_in
            .store(self.requested_in.load(Relaxed).wrapping_add(size), Relaxed);
    }

    /// [`add_requested`](Self::add_requested) in one instruction where the target has one
    /// that adds to memory (x86-64): the global allocator's fast path counts the request
    /// in whichever lane it allocates from, lane 0 included (whose figure nobody reads), so
    /// that a scoped tag's allocations cost no branch.
    #[inline(always)]
    pub(super) fn add_requested_fast(&self, size: usize) {
        #[cfg(all(target_arch = "x86_64", not(miri)))]
        // SAFETY: a relaxed load of `requested_in`, the add, and a relaxed store of the sum:
        // only the owning thread writes the counter, and an aligned 8-byte store is atomic
        // on x86-64, so other threads' relaxed loads see the old or the new value, as with
        // `add_requested`. The address is a live field of this lane.
        unsafe {
            core::arch::asm!(
                "add qword ptr [{lane} + {offset}], {size}",
                lane = in(reg) ptr::from_ref(self),
                offset = const core::mem::offset_of!(Lane, requested_in),
                size = in(reg) size,
                options(nostack),
            );
        }
        #[cfg(not(all(target_arch = "x86_64", not(miri))))]
        self.add_requested(size);
    }

    /// Uncounts `size` requested bytes of a block the owner just gave back to this lane.
    #[inline(always)]
    pub(super) fn sub_requested(&self, size: usize) {
        self.requested_out
            .store(self.requested_out.load(Relaxed).wrapping_add(size), Relaxed);
    }

    /// [`sub_requested`](Self::sub_requested) in one instruction where the target has one
    /// (see [`add_requested_fast`](Self::add_requested_fast)).
    #[inline(always)]
    pub(super) fn sub_requested_fast(&self, size: usize) {
        #[cfg(all(target_arch = "x86_64", not(miri)))]
        // SAFETY: as in `add_requested_fast`, for `requested_out`.
        unsafe {
            core::arch::asm!(
                "add qword ptr [{lane} + {offset}], {size}",
                lane = in(reg) ptr::from_ref(self),
                offset = const core::mem::offset_of!(Lane, requested_out),
                size = in(reg) size,
                options(nostack),
            );
        }
        #[cfg(not(all(target_arch = "x86_64", not(miri))))]
        self.sub_requested(size);
    }

    /// The owner, about to count an allocation through this lane open under a budget
    /// with hooks byte `hooks`: marks the allocation in flight, then looks at the gate
    /// again. `false` (nothing marked): the gate changed, the caller takes the general
    /// path. `true`: the caller counts the block, then calls
    /// [`budget_allocation_counted`](Self::budget_allocation_counted).
    ///
    /// Why: a thread deciding at a budget's limit first closes the lanes below it, then
    /// publishes them ([`wait_out_budget_allocation`](Self::wait_out_budget_allocation)
    /// on each, then their counts). Each side writes its word, then reads the other's,
    /// with a full barrier between (here a fence, or where `membarrier` works, the
    /// decider's process-wide barrier), so at least one sees the other: either this owner
    /// sees the closed gate, or the decider sees the mark and waits for the count. A block
    /// that read an open gate can then never be counted after a decision that missed it.
    #[inline]
    pub(super) fn announce_budget_allocation(&self, hooks: u8) -> bool {
        self.budget_in_flight.store(true, Relaxed);
        // Asymmetric fences where the process barrier works: the decider calls it, which
        // puts a full barrier between this store and load on whichever thread is between
        // them; a fence here cost about 10 ns, twice the whole allocation.
        if crate::sync::process_barrier_ready() {
            compiler_fence(SeqCst);
        } else {
            fence(SeqCst);
        }
        if self.hooks.load(Relaxed) == hooks {
            return true;
        }
        self.budget_in_flight.store(false, Relaxed);
        false
    }

    /// After [`announce_budget_allocation`](Self::announce_budget_allocation) and the
    /// count: the allocation is no longer in flight (Release: with its count).
    #[inline]
    pub(super) fn budget_allocation_counted(&self) {
        self.budget_in_flight.store(false, Release);
    }

    /// Waits until no allocation is in flight through this lane (see
    /// [`announce_budget_allocation`](Self::announce_budget_allocation)); its count is
    /// then visible. The caller closed the lane's gate and then called
    /// `sync::process_barrier`; the owner finishes an allocation in flight without any
    /// lock, so the caller may hold the thread registry's.
    pub(crate) fn wait_out_budget_allocation(&self) {
        let mut spins = 0u32;
        while self.budget_in_flight.load(Acquire) {
            if spins < 64 {
                spins += 1;
                core::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
    }

    /// Zeroes the counts and publication marks (the owner is retiring, everything has
    /// been published and absorbed elsewhere).
    pub(super) fn reset_counts(&self) {
        self.budget_in_flight.store(false, Relaxed);
        self.requested_in.store(0, Relaxed);
        self.requested_out.store(0, Relaxed);
        self.resizes.store(0, Relaxed);
        self.moves.store(0, Relaxed);
        for (slot, published) in self.slots.iter().zip(&self.published) {
            slot.allocations.store(0, Relaxed);
            slot.frees.store(0, Relaxed);
            published.store(0, Relaxed);
        }
    }
}

/// Asks the cache for the bin's new head, whose link the next allocation of the class reads:
/// a bin refilled long ago, or by frees scattered over the heap, would otherwise make that
/// allocation wait on a miss. A null head (empty bin) is harmless: a prefetch never faults.
#[inline(always)]
fn prefetch_head(next: *mut FreeSlot) {
    #[cfg(all(target_arch = "x86_64", not(miri)))]
    // SAFETY: a prefetch is a hint: it reads nothing the program sees and never faults,
    // whatever the address.
    unsafe {
        core::arch::x86_64::_mm_prefetch::<{ core::arch::x86_64::_MM_HINT_T0 }>(next.cast());
    }
    #[cfg(not(all(target_arch = "x86_64", not(miri))))]
    let _ = next;
}

#[cfg(test)]
mod tests {
    use super::{
        ASK, ClassKey, Lane, PLAIN_NEVER, ROUTE_LOWEST_LANE, ROUTE_NOWHERE, fast_key, is_route,
        is_routing, route_to, routed_lane, routed_lane_above_a_block, routes_nowhere, threshold_at,
    };
    use crate::allocator::thread_cache::{HOOK_FREE, HOOK_TAGS};
    use crate::schema::guarded::GUARDED_TAG;
    use crate::schema::hpha::size_class::{CLASS_COUNT, fast_class};
    use core::alloc::Layout;

    /// A route gives back its lane and the lane's free tag, and is above every block;
    /// nothing else `plain_from` holds (0, a threshold, `PLAIN_NEVER`) reads as a route,
    /// and no threshold's low bits match a segment tag; a lane that asks routes with a tag
    /// field no segment has; a lane too low to be named gets the route that matches nothing.
    #[test]
    fn routes_carry_the_lane_and_its_free_tag_and_nothing_else_is_a_route() {
        let lanes: Vec<Box<Lane>> = (0..3).map(|_| Box::new(Lane::new(HOOK_TAGS))).collect();
        for (tag, lane) in [0u16, 7, 4095].into_iter().zip(&lanes) {
            lane.tag.store(tag, core::sync::atomic::Ordering::Relaxed);
            lane.set_hooks(HOOK_TAGS);
            let route = route_to(lane);
            assert!(
                route.addr() >= 1 << 48,
                "{route:p} is not above every block"
            );
            assert!(is_route(route));
            if core::ptr::from_ref(&**lane).addr() < ROUTE_LOWEST_LANE {
                // Memory this low (valgrind places the heap there): a route nowhere.
                assert!(routes_nowhere(route) && routed_lane(route).is_none());
                assert_eq!(routed_lane_above_a_block(route, tag), None);
                continue;
            }
            let (to, field) = routed_lane(route).expect("a route");
            assert_eq!((to, field), (core::ptr::from_ref(&**lane), tag));
            assert_eq!(routed_lane_above_a_block(route, tag), Some(to));
            assert_eq!(routed_lane_above_a_block(route, tag + 1), None);
            // SAFETY: the lane is alive; the pointer came back through the exposed provenance.
            assert_eq!(unsafe { (*to).tag() }, tag);
            lane.set_hooks(HOOK_TAGS | HOOK_FREE);
            let (_, field) = routed_lane(route_to(lane)).expect("a route");
            assert_eq!(field, ASK & 0x7fff);
            assert_ne!(field, tag);
            assert_eq!(routed_lane_above_a_block(route_to(lane), tag), None);
        }
        for plain in [
            0,
            threshold_at(4096),
            threshold_at(0x7fff_ffff_f000),
            PLAIN_NEVER,
        ] {
            let word = core::ptr::without_provenance(plain);
            assert!(routed_lane(word).is_none(), "{plain:#x}");
            if plain != 0 {
                assert!(!is_route(word), "{plain:#x}");
                for tag in [0, 7, 4095, GUARDED_TAG, ASK] {
                    assert_eq!(routed_lane_above_a_block(word, tag), None, "{plain:#x}");
                }
            }
        }
        let nowhere = core::ptr::without_provenance(ROUTE_NOWHERE);
        assert!(routed_lane(nowhere).is_none() && is_route(nowhere) && is_routing(nowhere));
        assert!(
            !is_routing(core::ptr::null())
                && !is_routing(core::ptr::without_provenance(PLAIN_NEVER))
        );
        for tag in [0, 7, 4095, GUARDED_TAG, ASK] {
            assert_eq!(routed_lane_above_a_block(nowhere, tag), None);
        }
    }

    /// The key of every layout is its class's (so the fast paths index the slot the class
    /// would), and the class comes back from the key: exhaustive over small sizes and every
    /// alignment up to a page, plus the edges past them.
    #[test]
    fn fast_key_is_the_key_of_fast_class() {
        for align_log in 0..=13 {
            let align = 1usize << align_log;
            for size in 1..=4200 {
                let layout = Layout::from_size_align(size, align).unwrap();
                let class = fast_class(layout);
                assert_eq!(fast_key(layout), class.map(ClassKey::of), "{layout:?}");
                if let Some(class) = class {
                    assert_eq!(ClassKey::of(class).class(), class);
                }
            }
        }
        for class in 0..CLASS_COUNT {
            assert_eq!(ClassKey::of(class).class(), class);
        }
        assert_eq!(fast_key(Layout::from_size_align(0, 8).unwrap()), None);
    }
}
