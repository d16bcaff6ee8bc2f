//! The registry: every allocator in the process, with its name, description, kind and parent.
//!
//! Each allocator owns one [`Registration`] in a `static`, built in a `const` context. On
//! first use it links itself into a process-wide intrusive list with one compare-and-swap:
//! no allocation, no lock, and no limit on the number of allocators (O3DE stops at 100). A
//! registration is never unlinked (its `static` lives as long as the process), so walking
//! the list from any thread at any time is safe without a lock, even while other
//! allocators are joining it.
//!
//! The OS layer ([`OS`]) and the [`SystemAllocator`] ([`SYSTEM`]) are always registered,
//! as indices 0 and 1. A declared allocator registers its parent before itself, so a
//! parent's index is always below its children's.

use super::fork;
pub use super::fork::ForkLock;
use crate::budget::{Budget, BudgetMode};
use crate::child::ChildOps;
use crate::os::OsAllocator;
use crate::records::{self, RecordMode, RecordSettings};
use crate::stats::{AllocatorStats, Counters};
use crate::system::SystemAllocator;
use core::fmt;
use core::ptr;
use core::sync::atomic::{AtomicBool, AtomicPtr, AtomicU8, AtomicU32, AtomicUsize, Ordering};

/// What kind of allocator a registration describes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum AllocatorKind {
    /// The OS layer: pages from `mmap`.
    Os,
    /// The general-purpose heap ([`SystemAllocator`]).
    System,
    /// A pass-through to a parent that keeps its own statistics.
    Child,
    /// A fixed-size-class pool owned by one thread at a time.
    Pool,
    /// A pool with one sub-pool per thread.
    ThreadPool,
    /// tagalloc's own bookkeeping (the allocation records' heap), on the OS layer.
    Internal,
    /// Memory tagalloc never touches, managed from outside (an `ExternalMapAllocator` over a
    /// GPU heap, a file, a buffer): its figures are counted as a root of their own.
    External,
}

impl AllocatorKind {
    /// A lower-case name for reports (`"os"`, `"system"`, `"child"`, `"pool"`,
    /// `"thread_pool"`, `"internal"`, `"external"`).
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Os => "os",
            Self::System => "system",
            Self::Child => "child",
            Self::Pool => "pool",
            Self::ThreadPool => "thread_pool",
            Self::Internal => "internal",
            Self::External => "external",
        }
    }
}

/// Reads an allocator's figures for a snapshot.
pub type StatsReader = fn(&'static Registration) -> AllocatorStats;

const UNREGISTERED: u8 = 0;
const REGISTERING: u8 = 1;
const REGISTERED: u8 = 2;

/// One allocator's entry in the registry, with its counters and budget; lives in a `static`.
///
/// Declared allocators get theirs from [`allocator!`](crate::allocator); read it through
/// the handle's `registration()` or by walking [`allocators`].
pub struct Registration {
    name: &'static str,
    description: &'static str,
    kind: AllocatorKind,
    /// A function rather than a reference: the parent's `static` is private to the macro
    /// expansion that declared it, but its handle type can always name this function.
    parent: Option<fn() -> &'static Registration>,
    reader: StatsReader,
    counters: Counters,
    budget: Budget,
    records: RecordSettings,
    /// Guarded sampling: one allocation in this many placed against a guard page (0: off);
    /// see [`set_guarded`](Self::set_guarded).
    guard_every: AtomicU32,
    /// Whether code set [`guard_every`](Self::guard_every) (the environment then does not).
    guard_from_code: AtomicBool,
    /// The lock the fork handlers take for this allocator, if it has one (see `fork`).
    fork_lock: Option<ForkLock>,
    /// False for a child declared with `requested_bytes: false`, which does not count the
    /// bytes callers request (see [`with_requested_bytes`](Self::with_requested_bytes)).
    keeps_requested: bool,
    /// A child's calls, for the global allocator's scoped tags (see `crate::scope`).
    child_ops: Option<&'static ChildOps>,
    next: AtomicPtr<Registration>,
    index: AtomicUsize,
    state: AtomicU8,
}

/// The OS layer's entry: index 0, always registered.
pub static OS: Registration = Registration {
    state: AtomicU8::new(REGISTERED),
    index: AtomicUsize::new(0),
    ..Registration::new(
        "OSAllocator",
        "Pages mapped from the operating system",
        AllocatorKind::Os,
        None,
        read_os,
    )
};

/// The [`SystemAllocator`]'s registry index (it is always registered).
pub(crate) const SYSTEM_INDEX: usize = 1;

/// The [`SystemAllocator`]'s entry: index 1, always registered; its parent is [`OS`].
pub static SYSTEM: Registration = Registration {
    // Its first call reads the environment, so that even that call can be recorded.
    records: RecordSettings::pending_env(),
    state: AtomicU8::new(REGISTERED),
    index: AtomicUsize::new(SYSTEM_INDEX),
    next: AtomicPtr::new(ptr::addr_of!(OS).cast_mut()),
    ..Registration::new(
        "SystemAllocator",
        "General-purpose HPHA heap",
        AllocatorKind::System,
        Some(os_registration),
        read_system,
    )
};

/// The most recently registered allocator: the head of the intrusive list.
static HEAD: AtomicPtr<Registration> = AtomicPtr::new(ptr::addr_of!(SYSTEM).cast_mut());
/// The index the next registration gets.
static NEXT_INDEX: AtomicUsize = AtomicUsize::new(2);

fn os_registration() -> &'static Registration {
    &OS
}

fn read_os(_: &'static Registration) -> AllocatorStats {
    let os = OsAllocator::stats();
    AllocatorStats {
        live_granted_bytes: os.mapped_bytes,
        live_requested_bytes: None,
        live_blocks: os.map_calls.saturating_sub(os.unmap_calls),
        allocations: os.map_calls as u64,
        frees: os.unmap_calls as u64,
        reallocations: 0,
        peak_granted_bytes: Some(os.peak_mapped_bytes),
        reserved_bytes: os.mapped_bytes,
        over_budget: 0,
        budget_failures: 0,
        heap: None,
    }
}

/// The highest live granted figure of the [`SystemAllocator`] any reading has seen (see
/// [`read_system`]).
static SYSTEM_PEAK_SEEN: AtomicUsize = AtomicUsize::new(0);

/// The [`SystemAllocator`]'s figures. Its peak is the highest live figure seen by a reading
/// (a snapshot, a report, `stats()`, a [`mark_frame`](crate::report::mark_frame)): its
/// thread caches count blocks per thread without a shared running total, which a true peak
/// would need on every call. A program that marks frames gets the peak per frame.
fn read_system(_: &'static Registration) -> AllocatorStats {
    let heap = SystemAllocator::new().heap_stats();
    let peak = SYSTEM_PEAK_SEEN
        .fetch_max(heap.granted_bytes, Ordering::Relaxed)
        .max(heap.granted_bytes);
    AllocatorStats {
        live_granted_bytes: heap.granted_bytes,
        live_requested_bytes: None,
        live_blocks: heap.live_blocks,
        allocations: heap.allocations,
        frees: heap.frees,
        reallocations: 0,
        peak_granted_bytes: Some(peak),
        reserved_bytes: heap.held_bytes,
        over_budget: 0,
        budget_failures: 0,
        heap: Some(heap),
    }
}

impl Registration {
    /// An unregistered entry. `parent` returns the parent's entry; `reader` produces the
    /// figures for snapshots (use [`Registration::read_counters`] for allocators whose
    /// figures are all in their own counters).
    pub const fn new(
        name: &'static str,
        description: &'static str,
        kind: AllocatorKind,
        parent: Option<fn() -> &'static Registration>,
        reader: StatsReader,
    ) -> Self {
        Self {
            name,
            description,
            kind,
            parent,
            reader,
            counters: Counters::new(),
            budget: Budget::new(),
            records: RecordSettings::new(),
            guard_every: AtomicU32::new(0),
            guard_from_code: AtomicBool::new(false),
            fork_lock: None,
            keeps_requested: true,
            child_ops: None,
            next: AtomicPtr::new(ptr::null_mut()),
            index: AtomicUsize::new(usize::MAX),
            state: AtomicU8::new(UNREGISTERED),
        }
    }

    /// This entry, with a lock that the `fork()` handlers take before a fork (waiting for
    /// any thread inside the allocator to leave it) and release after, so a child process
    /// never inherits it held. For allocators with a lock of their own: the pool cores
    /// behind `allocator!` handles use it. See [`ForkLock`] for the contract.
    pub const fn with_fork_lock(self, lock: ForkLock) -> Self {
        Self {
            fork_lock: Some(lock),
            ..self
        }
    }

    /// This entry, for a child that counts the bytes callers request (`true`, the default)
    /// or not (`false`: declared with `requested_bytes: false`). Without them its
    /// statistics say `live_requested_bytes: None`, and so do those of every allocator
    /// above it once it is registered (their figures include its blocks); in exchange its
    /// small alloc+free pair is exactly its parent's work in another lane, without the two
    /// memory writes that figure costs.
    pub const fn with_requested_bytes(self, keeps: bool) -> Self {
        Self {
            keeps_requested: keeps,
            counters: if keeps {
                self.counters
            } else {
                self.counters.without_requested()
            },
            ..self
        }
    }

    /// This entry, for a child whose calls are `ops` (what [`allocator!`](crate::allocator)
    /// gives every child), so that a scoped tag can route the global allocator's calls to it.
    #[doc(hidden)]
    pub const fn with_child_ops(self, ops: &'static ChildOps) -> Self {
        Self {
            child_ops: Some(ops),
            ..self
        }
    }

    /// A child's calls, if it was declared with them.
    pub(crate) fn child_ops(&self) -> Option<&'static ChildOps> {
        self.child_ops
    }

    /// Whether this allocator counts the bytes callers request (see
    /// [`with_requested_bytes`](Self::with_requested_bytes)).
    pub fn keeps_requested_bytes(&self) -> bool {
        self.keeps_requested
    }

    /// The reader for allocators whose figures are all in their [`Counters`] (children):
    /// reserved bytes equal live granted bytes.
    pub fn read_counters(this: &'static Registration) -> AllocatorStats {
        this.counters.snapshot()
    }

    /// Links this entry into the registry if it is not yet (after its parent). Cheap when
    /// already registered: one load. Never allocates; if another thread is registering the
    /// same entry, waits the few instructions it takes to finish.
    #[inline]
    pub fn register(&'static self) {
        if self.state.load(Ordering::Acquire) != REGISTERED {
            self.register_slow();
        }
    }

    #[cold]
    #[inline(never)]
    fn register_slow(&'static self) {
        if !self.keeps_requested {
            // Before the entry is linked, so before any of its blocks exist: every figure
            // above that would include them stops reporting requested bytes (its own never
            // did, see `with_requested_bytes`).
            let mut entry = self.parent();
            while let Some(e) = entry {
                e.counters.forget_requested();
                entry = e.parent();
            }
        }
        if let Some(parent) = self.parent {
            parent().register();
        }
        if self.fork_lock.is_some() {
            fork::install();
        }
        // Linked under the fork gate: no fork copies an entry half linked (left
        // `REGISTERING` for ever in the child), and the fork handlers see every entry whose
        // lock may be held.
        let linked = fork::publish(|| self.link());
        if !linked {
            // Another thread is linking it in: wait the few instructions that takes, so that
            // when this returns the entry is registered (and a child registering after it
            // gets a later index than its parent).
            while self.state.load(Ordering::Acquire) != REGISTERED {
                core::hint::spin_loop();
            }
            return;
        }
        // A `TAGALLOC_RECORDS` entry may name this allocator.
        records::env::on_register(self);
    }

    /// Links this entry at the head of the list; `false` if another thread got there first.
    fn link(&'static self) -> bool {
        if self
            .state
            .compare_exchange(
                UNREGISTERED,
                REGISTERING,
                Ordering::Acquire,
                Ordering::Acquire,
            )
            .is_err()
        {
            return false;
        }
        self.index.store(
            NEXT_INDEX.fetch_add(1, Ordering::Relaxed),
            Ordering::Relaxed,
        );
        let me = ptr::from_ref(self).cast_mut();
        let mut head = HEAD.load(Ordering::Relaxed);
        loop {
            self.next.store(head, Ordering::Relaxed);
            // Release: a walker that sees `me` at the head also sees `next` and `index`.
            match HEAD.compare_exchange_weak(head, me, Ordering::Release, Ordering::Relaxed) {
                Ok(_) => break,
                Err(current) => head = current,
            }
        }
        self.state.store(REGISTERED, Ordering::Release);
        true
    }

    /// How many parents this allocator has above it.
    fn depth(&self) -> usize {
        let mut depth = 0;
        let mut above = self.parent();
        while let Some(parent) = above {
            depth += 1;
            above = parent.parent();
        }
        depth
    }

    /// Whether this entry is in the registry.
    pub fn is_registered(&self) -> bool {
        self.state.load(Ordering::Acquire) == REGISTERED
    }

    /// The allocator's name (for declared allocators, the handle type's name).
    pub fn name(&self) -> &'static str {
        self.name
    }

    /// What the allocator is for.
    pub fn description(&self) -> &'static str {
        self.description
    }

    /// The allocator's kind.
    pub fn kind(&self) -> AllocatorKind {
        self.kind
    }

    /// The allocator this one draws its memory from (`None` for the OS layer).
    pub fn parent(&self) -> Option<&'static Registration> {
        self.parent.map(|f| f())
    }

    /// The position in registration order (0 = OS layer, 1 = SystemAllocator), or `None`
    /// while not registered.
    pub fn index(&self) -> Option<usize> {
        match self.index.load(Ordering::Relaxed) {
            usize::MAX => None,
            i => Some(i),
        }
    }

    /// A snapshot of this allocator's figures.
    pub fn stats(&'static self) -> AllocatorStats {
        let mut stats = (self.reader)(self);
        let budget = self.counters.snapshot();
        stats.over_budget = budget.over_budget;
        stats.budget_failures = budget.budget_failures;
        stats
    }

    /// The live counters (what children and pools update on every call).
    pub fn counters(&self) -> &Counters {
        &self.counters
    }

    /// Whether this allocator, a child of the [`SystemAllocator`] (or of its children),
    /// serves its small blocks from lanes of its own in the thread caches: every such child
    /// gets a tag (up to [`MAX_TAGS`](crate::schema::hpha::MAX_TAGS)) before its first block,
    /// and its small allocations and frees then cost about what the `SystemAllocator`'s do.
    /// The lane steps aside while the child, or a child above it, has a budget or records,
    /// or the `SystemAllocator` records every block; see
    /// [`thread_cache_lane_open`](Self::thread_cache_lane_open).
    pub fn has_thread_cache_lane(&self) -> bool {
        self.counters.tag().is_some()
    }

    /// Whether this allocator has a lane of the thread caches (see
    /// [`has_thread_cache_lane`](Self::has_thread_cache_lane)) and the lane is open now, so
    /// that its small calls take it.
    pub fn thread_cache_lane_open(&'static self) -> bool {
        crate::lanes::is_open_for(self)
    }

    /// The byte budget settings.
    pub fn budget(&self) -> &Budget {
        &self.budget
    }

    /// Sets (`Some(bytes)`) or removes (`None`) a budget on live granted bytes, and what
    /// going over does. Only allocators that count their own blocks (children, pools)
    /// enforce budgets; on the OS and System entries a budget has no effect.
    ///
    /// The limit and the mode change together: a call under way sees the old setting or
    /// the new one, never one's limit with the other's mode. A limit of `isize::MAX` bytes
    /// or more is kept as `isize::MAX - 1`.
    pub fn set_budget(&self, bytes: Option<usize>, mode: BudgetMode) {
        self.budget.set(bytes, mode);
        self.sync_route_flags();
    }

    /// Brings the route's budget and records flags (see `Counters::plain_slot`) in line with
    /// the settings as they are now. Threads changing the settings at the same time each
    /// read the settings again after writing a flag, and write again if they moved: the last
    /// flag written was then computed from the last settings (every write to the route is
    /// a read-modify-write, so that write follows the last setter's settings store). Read
    /// once without the loop, two setters could leave a budget set and the flag clear, and
    /// calls would skip the budget.
    fn sync_route_flags(&self) {
        loop {
            let budget = self.budget.settings();
            let records = self.records.word();
            self.counters.set_budgeted(budget.is_set());
            self.counters.set_recorded(records != 0);
            if self.budget.settings() == budget && self.records.word() == records {
                return;
            }
        }
    }

    /// The allocator's record settings (what its allocation and free paths test).
    #[inline(always)]
    pub(crate) fn records(&self) -> &RecordSettings {
        &self.records
    }

    /// What this allocator records (see [`records`]).
    pub fn record_mode(&self) -> RecordMode {
        self.records.mode()
    }

    /// Whether this allocator can keep records: every allocator except the OS layer and
    /// tagalloc's own bookkeeping.
    pub fn records_supported(&self) -> bool {
        !matches!(self.kind, AllocatorKind::Os | AllocatorKind::Internal)
    }

    /// Sets what this allocator records from now on; overrides `TAGALLOC_RECORDS`
    /// (the environment is read first, so it never overrides this later). Registers the
    /// allocator if it was not yet. No effect where records are not supported.
    pub fn set_records(&'static self, mode: RecordMode) {
        records::env::ensure_read();
        self.register();
        if !self.records_supported() {
            return;
        }
        if mode.is_on() {
            records::activate();
        }
        self.records.set(mode, true);
        self.records_changed();
    }

    /// Applies a mode from the environment (unless code has set one).
    pub(crate) fn apply_records_from_env(&self, mode: RecordMode) {
        if mode.is_on() {
            records::activate();
        }
        self.records.set(mode, false);
        self.records_changed();
    }

    /// After this allocator's record settings changed: the `SystemAllocator`'s fast paths
    /// read a per-thread mirror of them, which is rewritten here.
    pub(crate) fn records_changed(&self) {
        self.sync_route_flags();
        if core::ptr::eq(self, &SYSTEM) {
            crate::thread_cache::system_records_changed();
        } else {
            // A child with records takes its general path (see `lanes`).
            crate::lanes::refresh();
        }
    }
}

/// Guarded sampling (see [`crate::guarded`]).
impl Registration {
    /// Whether guarded sampling can place this allocator's blocks: the `SystemAllocator`,
    /// and children whose chain of parents is children down to it (their blocks are the
    /// `SystemAllocator`'s). Pools carve their own pages, so neither they nor their
    /// children can.
    pub fn guarded_supported(&self) -> bool {
        let mut r = self;
        loop {
            match r.kind {
                AllocatorKind::System => return true,
                AllocatorKind::Child => match r.parent() {
                    Some(parent) => r = parent,
                    None => return false,
                },
                _ => return false,
            }
        }
    }

    /// Places one allocation in `every` (chosen at random, `every` on average apart) of
    /// this allocator's blocks of up to 4 KiB against an inaccessible page, so that a read
    /// or write past such a block's end stops the program at once with a message naming
    /// this allocator and the block ([`crate::guarded`] says how). `None` stops placing
    /// new ones. Overrides `TAGALLOC_GUARDED`. Returns `false`, changing nothing, where
    /// [`guarded_supported`](Self::guarded_supported) is false.
    pub fn set_guarded(&'static self, every: Option<core::num::NonZeroU32>) -> bool {
        records::env::ensure_read();
        self.register();
        if !self.guarded_supported() {
            return false;
        }
        self.guard_from_code.store(true, Ordering::Relaxed);
        self.apply_guarded(every.map_or(0, core::num::NonZeroU32::get));
        true
    }

    /// One allocation in how many this allocator guards, if it does (after the
    /// environment has been read).
    pub fn guarded(&self) -> Option<core::num::NonZeroU32> {
        records::env::ensure_read();
        core::num::NonZeroU32::new(self.guard_every.load(Ordering::Relaxed))
    }

    /// The rate as it stands, for the lanes (0: none).
    pub(crate) fn guard_every(&self) -> Option<u32> {
        core::num::NonZeroU32::new(self.guard_every.load(Ordering::Relaxed)).map(|n| n.get())
    }

    /// Applies a rate from the environment (unless code has set one).
    pub(crate) fn apply_guarded_from_env(&'static self, every: u32) {
        if self.guarded_supported() && !self.guard_from_code.load(Ordering::Relaxed) {
            self.apply_guarded(every);
        }
    }

    fn apply_guarded(&'static self, every: u32) {
        if every != 0 {
            crate::guarded::enable();
        }
        self.guard_every.store(every, Ordering::Relaxed);
        if core::ptr::eq(self, &SYSTEM) {
            // Lane 0's marks close, so each thread draws its countdowns afresh; the lanes'
            // gates are recomputed too (the `SystemAllocator`'s rate applies to them).
            crate::thread_cache::system_records_changed();
        } else {
            crate::lanes::claim(self);
            crate::lanes::refresh();
        }
    }
}

impl fmt::Debug for Registration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Registration")
            .field("name", &self.name)
            .field("kind", &self.kind)
            .field("index", &self.index())
            .field("parent", &self.parent().map(|p| p.name))
            .field("records", &self.record_mode())
            .finish_non_exhaustive()
    }
}

/// Walks every registered allocator, most recently registered first. Lock-free and
/// allocation-free; allocators registered during the walk may or may not be seen.
///
/// ```
/// let names: Vec<&str> = tagalloc::registry::allocators().map(|r| r.name()).collect();
/// assert!(names.contains(&"SystemAllocator") && names.contains(&"OSAllocator"));
/// ```
pub fn allocators() -> Allocators {
    Allocators {
        next: HEAD.load(Ordering::Acquire),
    }
}

/// Iterator over the registry; see [`allocators`].
#[derive(Clone, Debug)]
pub struct Allocators {
    next: *const Registration,
}

impl Iterator for Allocators {
    type Item = &'static Registration;

    fn next(&mut self) -> Option<&'static Registration> {
        // SAFETY: list pointers come from `&'static Registration`s, never unlinked; the acquire
        // load of HEAD (or of the previous `next`) made the entry's fields visible.
        let entry = unsafe { self.next.as_ref()? };
        self.next = entry.next.load(Ordering::Acquire);
        Some(entry)
    }
}

/// The allocators whose fork locks the prepare handler holds: the registry as it was when
/// it took them (entries are only ever added at the head, so the list from that head is the
/// same set at release time).
pub(crate) struct HeldForFork {
    head: AtomicPtr<Registration>,
}

impl HeldForFork {
    pub(crate) const fn new() -> Self {
        Self {
            head: AtomicPtr::new(ptr::null_mut()),
        }
    }

    /// Takes the fork lock of every registered allocator that has one, deepest in the tree
    /// first (an allocator's lock can be held while its parent's is taken, never the other
    /// way round).
    pub(crate) fn hold(&self) {
        let head = HEAD.load(Ordering::Acquire);
        self.head.store(head, Ordering::Relaxed);
        let lockable =
            || Allocators { next: head }.filter_map(|r| r.fork_lock.map(|lock| (r.depth(), lock)));
        let Some(deepest) = lockable().map(|(depth, _)| depth).max() else {
            return;
        };
        for depth in (0..=deepest).rev() {
            for (_, lock) in lockable().filter(|&(d, _)| d == depth) {
                (lock.hold)();
            }
        }
    }

    /// Releases what [`hold`](Self::hold) took.
    ///
    /// # Safety
    /// Once after each `hold`, on the thread that called it (or in the child it forked),
    /// with no guard of those locks live.
    pub(crate) unsafe fn release(&self) {
        let head = self.head.load(Ordering::Relaxed);
        for registration in (Allocators { next: head }) {
            if let Some(lock) = registration.fork_lock {
                // SAFETY: taken by `hold`, as the caller guarantees; released once.
                unsafe { (lock.release)() };
            }
        }
    }
}

// SAFETY: the iterator only holds a pointer to a `'static`, `Sync` registration.
unsafe impl Send for Allocators {}
// SAFETY: as above; shared access never mutates through the pointer.
unsafe impl Sync for Allocators {}

#[cfg(test)]
mod tests {
    use super::*;

    static A: Registration = Registration::new(
        "RegistryTestA",
        "a",
        AllocatorKind::Child,
        Some(system),
        Registration::read_counters,
    );
    static B: Registration = Registration::new(
        "RegistryTestB",
        "b",
        AllocatorKind::Child,
        Some(a),
        Registration::read_counters,
    );
    fn system() -> &'static Registration {
        &SYSTEM
    }
    fn a() -> &'static Registration {
        &A
    }

    #[test]
    fn miri_registering_a_child_registers_its_parent_first() {
        assert!(!B.is_registered());
        std::thread::scope(|s| {
            for _ in 0..4 {
                s.spawn(|| B.register());
            }
        });
        B.register();
        let ia = A.index().unwrap();
        let ib = B.index().unwrap();
        assert!(1 < ia && ia < ib);
        let found: Vec<_> = allocators()
            .filter(|r| r.name().starts_with("RegistryTest"))
            .collect();
        assert_eq!(found.len(), 2);
        assert_eq!(B.parent().unwrap().name(), "RegistryTestA");
        assert_eq!(OS.index(), Some(0));
        assert_eq!(SYSTEM.parent().unwrap().name(), "OSAllocator");
    }

    /// Fork locks that log the order they are taken and released in.
    mod logged {
        use core::sync::atomic::{AtomicUsize, Ordering::SeqCst};
        pub static HELD: [AtomicUsize; 3] = [const { AtomicUsize::new(0) }; 3];
        pub static RELEASED: [AtomicUsize; 3] = [const { AtomicUsize::new(0) }; 3];
        static CLOCK: AtomicUsize = AtomicUsize::new(1);
        fn tick(slot: &AtomicUsize) {
            slot.store(CLOCK.fetch_add(1, SeqCst), SeqCst);
        }
        pub fn hold_top() {
            tick(&HELD[0]);
        }
        pub fn hold_middle() {
            tick(&HELD[1]);
        }
        pub fn hold_bottom() {
            tick(&HELD[2]);
        }
        pub unsafe fn release_top() {
            tick(&RELEASED[0]);
        }
        pub unsafe fn release_middle() {
            tick(&RELEASED[1]);
        }
        pub unsafe fn release_bottom() {
            tick(&RELEASED[2]);
        }
    }

    // Registered bottom first; the tree is SystemAllocator > Top > Middle > Bottom.
    static TOP: Registration = Registration::new(
        "ForkOrderTop",
        "",
        AllocatorKind::Pool,
        Some(system),
        Registration::read_counters,
    )
    .with_fork_lock(ForkLock {
        hold: logged::hold_top,
        release: logged::release_top,
    });
    static MIDDLE: Registration = Registration::new(
        "ForkOrderMiddle",
        "",
        AllocatorKind::Pool,
        Some(top),
        Registration::read_counters,
    )
    .with_fork_lock(ForkLock {
        hold: logged::hold_middle,
        release: logged::release_middle,
    });
    static BOTTOM: Registration = Registration::new(
        "ForkOrderBottom",
        "",
        AllocatorKind::Pool,
        Some(middle),
        Registration::read_counters,
    )
    .with_fork_lock(ForkLock {
        hold: logged::hold_bottom,
        release: logged::release_bottom,
    });
    fn top() -> &'static Registration {
        &TOP
    }
    fn middle() -> &'static Registration {
        &MIDDLE
    }

    #[test]
    fn fork_locks_are_taken_deepest_first_and_all_released() {
        use core::sync::atomic::Ordering::SeqCst;
        BOTTOM.register();
        assert_eq!(BOTTOM.depth(), 4); // OS > System > Top > Middle > Bottom
        let held = HeldForFork::new();
        held.hold();
        let at =
            |slots: &[core::sync::atomic::AtomicUsize; 3]| [0, 1, 2].map(|i| slots[i].load(SeqCst));
        let [top, middle, bottom] = at(&logged::HELD);
        assert!(
            0 < bottom && bottom < middle && middle < top,
            "{bottom} {middle} {top}"
        );
        assert_eq!(at(&logged::RELEASED), [0, 0, 0]);
        // SAFETY: after `hold`, on this thread; the logged locks hold nothing.
        unsafe { held.release() };
        assert!(at(&logged::RELEASED).iter().all(|&t| t > top));
    }
}
