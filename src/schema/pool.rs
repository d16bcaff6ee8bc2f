//! [`PoolSchema`]: a very fast fixed-size-class pool for one thread, as O3DE's PoolSchema.
//!
//! Requests between a minimum and a maximum size are rounded up to a multiple of the minimum
//! (and of their alignment) and served from pages of that size class; pages come from a
//! [`PageParent`]. Everything else is refused with `None`: a pool is a specialised allocator,
//! and a caller that wants a fallback chooses it explicitly.
//!
//! The schema is not thread-safe by contract (`!Sync`): it is an owned value inside a
//! single-threaded subsystem, so its fast path takes no lock and no atomic. The thread-safe
//! variant is [`ThreadPoolSchema`](crate::schema::thread_pool::ThreadPoolSchema); both share
//! the page engine in `pool/page.rs`, the configuration ([`PoolConfig`]) and the statistics
//! ([`PoolStats`]).

pub(crate) mod bins;
pub(crate) mod page;

use super::{Allocation, PageParent};
use crate::fatal::{StackText, fatal};
use crate::messages::warn;
use crate::system::SystemAllocator;
use bins::Bins;
use core::alloc::Layout;
use core::cell::UnsafeCell;
use core::fmt::{self, Write};
use core::ptr::NonNull;
use core::sync::atomic::{AtomicUsize, Ordering};
use page::{HEADER_FIXED, PageHeader, Pages, check_owner, marker, marker_key, page_of};

pub use page::MAX_CLASSES;

/// The smallest page size a pool accepts: below it the page header would crowd out blocks.
pub const MIN_PAGE_SIZE: usize = 1024;
/// The largest page size a pool accepts (the checked-build bitmap grows with the page).
pub const MAX_PAGE_SIZE: usize = 1 << 24;

/// A pool's geometry: page size, smallest and largest block, and a name for messages.
///
/// Built only through [`PoolConfig::new`], which validates it, so every `PoolConfig` is
/// usable. The rules are O3DE's, plus the bounds this implementation needs:
/// - `min_size` is a power of two of at least `size_of::<usize>()` (a free block stores a
///   link);
/// - `max_size` is a multiple of `min_size`, and there are at most [`MAX_CLASSES`] classes
///   (`max_size / min_size`);
/// - `page_size` is a power of two (headers are found by masking), at least `4 × max_size`
///   (at least four blocks per page, as in O3DE) and [`MIN_PAGE_SIZE`], at most
///   [`MAX_PAGE_SIZE`].
///
/// ```
/// use tagalloc::schema::pool::{PoolConfig, PoolConfigError};
///
/// // O3DE's custom-pool test geometry.
/// let cfg = PoolConfig::new(1024, 64, 256).unwrap().with_name("particles");
/// assert_eq!(cfg.class_count(), 4);
/// assert!(matches!(
///     PoolConfig::new(4096, 12, 48),
///     Err(PoolConfigError::MinSizeNotPowerOfTwo { min_size: 12 })
/// ));
/// // In a constant: a bad geometry is a compile-time error.
/// const PARTICLES: PoolConfig = match PoolConfig::new(1024, 64, 256) {
///     Ok(c) => c,
///     Err(_) => panic!("bad pool geometry"),
/// };
/// assert_eq!(PARTICLES.page_size(), 1024);
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PoolConfig {
    page_size: usize,
    min_size: usize,
    max_size: usize,
    min_shift: u32,
    header_size: usize,
    bitmap_words: usize,
    name: &'static str,
}

/// Why a [`PoolConfig`] was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PoolConfigError {
    /// `min_size` is not a power of two.
    MinSizeNotPowerOfTwo {
        /// The value given.
        min_size: usize,
    },
    /// `min_size` is smaller than a pointer, which a free block must hold.
    MinSizeTooSmall {
        /// The value given.
        min_size: usize,
        /// The smallest accepted.
        smallest: usize,
    },
    /// `max_size` is below `min_size`.
    MaxSizeBelowMin {
        /// The values given.
        min_size: usize,
        /// The values given.
        max_size: usize,
    },
    /// `max_size` is not a multiple of `min_size`.
    MaxSizeNotMultipleOfMin {
        /// The values given.
        min_size: usize,
        /// The values given.
        max_size: usize,
    },
    /// `max_size / min_size` exceeds [`MAX_CLASSES`].
    TooManyClasses {
        /// `max_size / min_size`.
        classes: usize,
        /// [`MAX_CLASSES`].
        limit: usize,
    },
    /// `page_size` is not a power of two.
    PageSizeNotPowerOfTwo {
        /// The value given.
        page_size: usize,
    },
    /// `page_size` is below `4 × max_size` or below [`MIN_PAGE_SIZE`].
    PageSizeTooSmall {
        /// The value given.
        page_size: usize,
        /// The smallest accepted for this `max_size`.
        needed: usize,
    },
    /// `page_size` is above [`MAX_PAGE_SIZE`].
    PageSizeTooLarge {
        /// The value given.
        page_size: usize,
        /// [`MAX_PAGE_SIZE`].
        limit: usize,
    },
}

impl fmt::Display for PoolConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Self::MinSizeNotPowerOfTwo { min_size } => {
                write!(f, "pool min size {min_size} is not a power of two")
            }
            Self::MinSizeTooSmall { min_size, smallest } => {
                write!(f, "pool min size {min_size} is below {smallest} bytes")
            }
            Self::MaxSizeBelowMin { min_size, max_size } => {
                write!(f, "pool max size {max_size} is below min size {min_size}")
            }
            Self::MaxSizeNotMultipleOfMin { min_size, max_size } => write!(
                f,
                "pool max size {max_size} is not a multiple of min size {min_size}"
            ),
            Self::TooManyClasses { classes, limit } => {
                write!(
                    f,
                    "pool has {classes} size classes; at most {limit} are supported"
                )
            }
            Self::PageSizeNotPowerOfTwo { page_size } => {
                write!(f, "pool page size {page_size} is not a power of two")
            }
            Self::PageSizeTooSmall { page_size, needed } => {
                write!(f, "pool page size {page_size} is below {needed} bytes")
            }
            Self::PageSizeTooLarge { page_size, limit } => {
                write!(f, "pool page size {page_size} is above {limit} bytes")
            }
        }
    }
}

impl std::error::Error for PoolConfigError {}

impl PoolConfig {
    /// O3DE's defaults: 4 KiB pages, blocks of 8 to 512 bytes in steps of 8.
    pub const DEFAULT: PoolConfig = match Self::new(4096, 8, 512) {
        Ok(c) => c,
        Err(_) => panic!("the default pool geometry is valid"),
    };

    /// Validates a geometry. See the type's documentation for the rules.
    pub const fn new(
        page_size: usize,
        min_size: usize,
        max_size: usize,
    ) -> Result<Self, PoolConfigError> {
        let smallest = core::mem::size_of::<usize>();
        if !min_size.is_power_of_two() {
            return Err(PoolConfigError::MinSizeNotPowerOfTwo { min_size });
        }
        if min_size < smallest {
            return Err(PoolConfigError::MinSizeTooSmall { min_size, smallest });
        }
        if max_size < min_size {
            return Err(PoolConfigError::MaxSizeBelowMin { min_size, max_size });
        }
        if max_size % min_size != 0 {
            return Err(PoolConfigError::MaxSizeNotMultipleOfMin { min_size, max_size });
        }
        let classes = max_size / min_size;
        if classes > MAX_CLASSES {
            return Err(PoolConfigError::TooManyClasses {
                classes,
                limit: MAX_CLASSES,
            });
        }
        if !page_size.is_power_of_two() {
            return Err(PoolConfigError::PageSizeNotPowerOfTwo { page_size });
        }
        if page_size > MAX_PAGE_SIZE {
            return Err(PoolConfigError::PageSizeTooLarge {
                page_size,
                limit: MAX_PAGE_SIZE,
            });
        }
        let needed = if 4 * max_size > MIN_PAGE_SIZE {
            4 * max_size
        } else {
            MIN_PAGE_SIZE
        };
        if page_size < needed {
            return Err(PoolConfigError::PageSizeTooSmall { page_size, needed });
        }
        // One bit per `min_size` bytes of the page, in checked builds only.
        let bitmap_words = if page::CHECKED {
            (page_size / min_size).div_ceil(64)
        } else {
            0
        };
        // With page >= 1024 and >= 4 * max, the header (<= 128 bytes + page / 64) leaves room
        // for at least three blocks of the largest class.
        let header_size = HEADER_FIXED + bitmap_words * 8;
        Ok(Self {
            page_size,
            min_size,
            max_size,
            min_shift: min_size.trailing_zeros(),
            header_size,
            bitmap_words,
            name: "pool",
        })
    }

    /// The same geometry under another name, used in diagnostics.
    pub const fn with_name(mut self, name: &'static str) -> Self {
        self.name = name;
        self
    }

    /// Bytes per page, which is also the pages' alignment.
    pub const fn page_size(&self) -> usize {
        self.page_size
    }

    /// The smallest block (and the step between classes).
    pub const fn min_size(&self) -> usize {
        self.min_size
    }

    /// The largest block.
    pub const fn max_size(&self) -> usize {
        self.max_size
    }

    /// The number of size classes, `max_size / min_size`.
    pub const fn class_count(&self) -> usize {
        self.max_size / self.min_size
    }

    /// The name used in diagnostics.
    pub const fn name(&self) -> &'static str {
        self.name
    }

    /// The largest alignment any request can have: the largest power of two not above
    /// `max_size`.
    pub const fn max_align(&self) -> usize {
        1 << (usize::BITS - 1 - self.max_size.leading_zeros())
    }

    /// The block size a request for `layout` gets, or `None` if the pool cannot serve it
    /// (too large once rounded up to its alignment). A zero-size request gets `min_size`.
    ///
    /// ```
    /// use core::alloc::Layout;
    /// use tagalloc::schema::pool::PoolConfig;
    ///
    /// let cfg = PoolConfig::DEFAULT;
    /// assert_eq!(cfg.block_size(Layout::from_size_align(20, 4).unwrap()), Some(24));
    /// assert_eq!(cfg.block_size(Layout::from_size_align(20, 64).unwrap()), Some(64));
    /// assert_eq!(cfg.block_size(Layout::from_size_align(513, 8).unwrap()), None);
    /// ```
    #[inline]
    pub const fn block_size(&self, layout: Layout) -> Option<usize> {
        match self.class_of(layout) {
            Some(class) => Some(self.class_size(class)),
            None => None,
        }
    }

    /// The class of a request: its size rounded up to `max(min_size, align)`.
    #[inline]
    pub(crate) const fn class_of(&self, layout: Layout) -> Option<usize> {
        let size = layout.size();
        if layout.align() <= self.min_size {
            // The common case: the class is the size's `min_size` step (a zero size gets
            // the first class).
            return if size <= self.max_size {
                Some(size.saturating_sub(1) >> self.min_shift)
            } else {
                None
            };
        }
        self.class_of_aligned(layout)
    }

    /// [`class_of`](Self::class_of) for an alignment above `min_size`: the size is rounded
    /// up to the alignment, so the block (carved from the page's aligned end) is aligned.
    const fn class_of_aligned(&self, layout: Layout) -> Option<usize> {
        let size = layout.size();
        let step = layout.align();
        if size > self.max_size || step > self.max_size {
            return None;
        }
        let rounded = if size == 0 {
            step
        } else {
            (size + step - 1) & !(step - 1)
        };
        if rounded > self.max_size {
            return None;
        }
        Some((rounded >> self.min_shift) - 1)
    }

    /// Bytes per block of `class`.
    #[inline]
    pub(crate) const fn class_size(&self, class: usize) -> usize {
        (class + 1) << self.min_shift
    }

    /// Bytes at the start of each page taken by the header (and bitmap).
    #[inline]
    pub(crate) const fn header_size(&self) -> usize {
        self.header_size
    }

    /// Words of the checked-build bitmap.
    #[inline]
    pub(crate) const fn bitmap_words(&self) -> usize {
        self.bitmap_words
    }

    /// The layout pages are allocated with.
    #[inline]
    pub(crate) const fn page_layout(&self) -> Layout {
        // SAFETY: the page size is a non-zero power of two no larger than MAX_PAGE_SIZE, so
        // it is a valid alignment and the size cannot overflow `isize` when rounded.
        unsafe { Layout::from_size_align_unchecked(self.page_size, self.page_size) }
    }
}

impl Default for PoolConfig {
    fn default() -> Self {
        Self::DEFAULT
    }
}

/// What a pool (or thread pool) holds and has done, read with `stats()`.
///
/// Byte figures count granted bytes (the class size) and requested bytes (the size in the
/// layout, as passed to allocate and to free: if a free passes a size other than the one
/// allocated, as `Allocator::deallocate` may, requested bytes move by the difference).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PoolStats {
    /// Bytes granted to live blocks (their class sizes).
    pub granted_bytes: usize,
    /// Bytes requested by live blocks (layout sizes).
    pub requested_bytes: usize,
    /// Live blocks.
    pub live_blocks: usize,
    /// Blocks handed out since the pool was created.
    pub allocations: u64,
    /// Blocks freed since the pool was created.
    pub frees: u64,
    /// The most bytes granted at once. Exact for a [`PoolSchema`]; see
    /// [`ThreadPoolSchema::stats`](crate::schema::thread_pool::ThreadPoolSchema::stats) for
    /// the thread pool's bound.
    pub peak_granted_bytes: usize,
    /// Bytes held from the parent: pages plus bookkeeping.
    pub reserved_bytes: usize,
    /// Pages held from the parent.
    pub pages: usize,
    /// Of those, pages serving no size class (kept for reuse; `garbage_collect` returns
    /// them). A class keeps its last page even when that page empties (so a class that
    /// frees and allocates its one block in turn does not take and give back a page each
    /// time): it is not counted here, though `garbage_collect` returns it too. Freed blocks
    /// wait in per-class bins before going back to their pages (see
    /// [`PoolSchema`]), so a page whose blocks all wait there is counted once they go back:
    /// a [`PoolSchema`] sends them back before answering, a [`ThreadPoolSchema`]'s thread
    /// when it next needs a page, is collected, or exits.
    ///
    /// [`ThreadPoolSchema`]: crate::schema::thread_pool::ThreadPoolSchema
    pub free_pages: usize,
    /// Bytes of bookkeeping held from the parent (per-thread heaps of a thread pool; 0 for a
    /// [`PoolSchema`]).
    pub bookkeeping_bytes: usize,
    /// Per-thread heaps created (thread pool only): at most the number of threads that used
    /// the pool at the same time, plus one shared fallback heap.
    pub thread_heaps: usize,
}

/// Source of unique pool ids, mixed into page markers so that a block of one pool freed into
/// another is recognised. Never reused, so a stale id never matches a new pool.
static NEXT_UID: AtomicUsize = AtomicUsize::new(1);

/// A fresh unique id for a pool.
pub(crate) fn next_uid() -> usize {
    NEXT_UID.fetch_add(1, Ordering::Relaxed)
}

/// Writes a note on stderr (in every build) that a request was refused, naming the pool and
/// its range, so that a program whose pool is outgrown learns which one and why before
/// `handle_alloc_error` aborts it; never allocates. `first` says whether this is the pool's
/// first refusal: only that one is noted, so a caller that tries the pool and falls back to
/// another allocator does not flood stderr.
#[cold]
#[inline(never)]
pub(crate) fn report_refused(cfg: &PoolConfig, layout: Layout, first: bool) {
    if first {
        let mut text = StackText::<320>::new();
        let _ = writeln!(
            text,
            "tagalloc: pool '{}': request of {} bytes aligned to {} refused: this pool serves \
             {}..={} bytes with alignment up to {} (further refusals are not noted)",
            cfg.name(),
            layout.size(),
            layout.align(),
            cfg.min_size(),
            cfg.max_size(),
            cfg.max_align()
        );
        warn(text.as_bytes());
    }
}

/// The class of a block being freed; aborts when the layout is one this pool never grants.
#[inline]
pub(crate) fn class_for_free(cfg: &PoolConfig, ptr: NonNull<u8>, layout: Layout) -> usize {
    match cfg.class_of(layout) {
        Some(class) => class,
        None => fatal!(
            "pool '{}': free of {:p} with a layout ({} bytes, align {}) this pool never grants",
            cfg.name(),
            ptr,
            layout.size(),
            layout.align()
        ),
    }
}

/// A single-threaded pool of fixed size classes with pages from a parent.
///
/// A freed block first waits in its class's bin (up to 16 KiB of blocks, 8 to 64 of them),
/// and the next allocation of the class takes it from there without touching a page. Bins
/// never make the pool grow: before asking the parent for a page, the pool gives the waiting
/// blocks back to their pages, and so do `garbage_collect` and `stats`.
///
/// ```
/// use core::alloc::Layout;
/// use tagalloc::schema::pool::{PoolConfig, PoolSchema};
///
/// let pool = PoolSchema::with_config(std::alloc::System, PoolConfig::DEFAULT.with_name("ui"));
/// let layout = Layout::new::<[u64; 3]>();
/// let block = pool.allocate(layout).expect("out of memory");
/// assert_eq!(block.size, 24);
/// // Out of range: refused, not an error.
/// assert!(pool.allocate(Layout::from_size_align(4096, 8).unwrap()).is_none());
/// // SAFETY: the block came from this pool with this layout.
/// unsafe { pool.deallocate(block.ptr, layout) };
/// assert_eq!(pool.stats().live_blocks, 0);
/// pool.garbage_collect();
/// assert_eq!(pool.stats().pages, 0);
/// ```
///
/// A pool is not shared between threads (it may be moved to another thread):
///
/// ```compile_fail
/// fn shared<T: Sync>(_: &T) {}
/// shared(&tagalloc::schema::pool::PoolSchema::new(std::alloc::System));
/// ```
pub struct PoolSchema<P: PageParent = SystemAllocator> {
    parent: P,
    config: PoolConfig,
    /// Whether a refused request was already noted on stderr.
    refusal_noted: core::cell::Cell<bool>,
    /// Everything that changes. Accessed only on the owning thread (`!Sync`), and never
    /// borrowed across a call to the parent, so a parent is free to do anything but call
    /// back into this pool.
    state: UnsafeCell<PoolState>,
}

#[repr(C)]
struct PoolState {
    /// Freed blocks waiting for reuse, in front of the pages.
    bins: Bins,
    pages: Pages,
    // The counters are laid out so that no two updated by the same call are neighbours:
    // otherwise the compiler merges their updates into one 16-byte load and store, and the
    // next call's 16-byte load, overlapping two earlier stores, cannot be forwarded from the
    // store buffer (a stall of a dozen cycles, which tripled the cost of a pair).
    granted: usize,
    peak: usize,
    allocations: u64,
    /// Page-marker key from the pool's unique id, assigned when the first page is
    /// installed (0 until then: no page can carry a marker made from it).
    key: usize,
    requested: usize,
    held_pages: usize,
    frees: u64,
}

// SAFETY: the pool owns its pages outright (no other thread refers to them), so moving it to
// another thread is sound when its parent can be moved too. It is not `Sync`.
unsafe impl<P: PageParent + Send> Send for PoolSchema<P> {}

impl<P: PageParent> PoolSchema<P> {
    /// A pool with O3DE's default geometry ([`PoolConfig::DEFAULT`]); allocates nothing
    /// until its first request.
    pub const fn new(parent: P) -> Self {
        Self::with_config(parent, PoolConfig::DEFAULT)
    }

    /// A pool with the given geometry; allocates nothing until its first request.
    pub const fn with_config(parent: P, config: PoolConfig) -> Self {
        Self {
            parent,
            config,
            refusal_noted: core::cell::Cell::new(false),
            state: UnsafeCell::new(PoolState {
                bins: Bins::new(&config),
                pages: Pages::new(),
                key: 0,
                granted: 0,
                requested: 0,
                allocations: 0,
                frees: 0,
                peak: 0,
                held_pages: 0,
            }),
        }
    }

    /// The pool's geometry.
    pub fn config(&self) -> &PoolConfig {
        &self.config
    }

    /// The parent the pages come from.
    pub fn parent(&self) -> &P {
        &self.parent
    }

    /// Allocates a block for `layout`: `None` when the request is outside the pool's range
    /// (too large, or too aligned once rounded) or the parent is out of memory. The pool's
    /// first refused request is noted on stderr with the pool's name and range.
    #[inline]
    pub fn allocate(&self, layout: Layout) -> Option<Allocation> {
        let Some(class) = self.config.class_of(layout) else {
            report_refused(&self.config, layout, !self.refusal_noted.replace(true));
            return None;
        };
        // SAFETY: `!Sync`: only this thread is in the pool, and no other borrow of the state
        // is live (none is kept across calls); `class` is below the class count.
        let mut slot = unsafe {
            let st = &mut *self.state.get();
            st.bins.allocate(&mut st.pages, class, &self.config)
        };
        if slot.is_null() {
            slot = self.allocate_slow(class)?;
        }
        let elem = self.config.class_size(class);
        // SAFETY: as above.
        let st = unsafe { &mut *self.state.get() };
        st.allocations += 1;
        st.granted += elem;
        st.requested = st.requested.wrapping_add(layout.size());
        if st.granted > st.peak {
            st.peak = st.granted;
        }
        Some(Allocation {
            // SAFETY: slots are inside pages, never null.
            ptr: unsafe { NonNull::new_unchecked(slot) },
            size: elem,
        })
    }

    /// Installs a page for `class` (an empty one, or a new one from the parent) and takes a
    /// slot from it.
    #[cold]
    fn allocate_slow(&self, class: usize) -> Option<*mut u8> {
        // SAFETY: as in `allocate`; the borrow ends before the parent is called. The bins hold
        // only blocks of this pool's pages.
        let reused = unsafe {
            let st = &mut *self.state.get();
            match st.pages.pop_empty() {
                Some(page) => Some(page),
                // Cached blocks of other classes may be all that keeps a page from
                // emptying: give them back before growing the pool.
                None if st.bins.flush(&mut st.pages, &self.config) > 0 => st.pages.pop_empty(),
                None => None,
            }
        };
        let page = match reused {
            Some(page) => page,
            None => {
                let page = self
                    .parent
                    .allocate_page(self.config.page_layout())?
                    .as_ptr()
                    .cast::<PageHeader>();
                // SAFETY: as in `allocate`.
                unsafe { (*self.state.get()).held_pages += 1 };
                page
            }
        };
        // SAFETY: as in `allocate`.
        let st = unsafe { &mut *self.state.get() };
        if st.key == 0 {
            st.key = marker_key(next_uid());
        }
        // SAFETY: the page is a page-sized, page-aligned block owned by this pool, in no
        // list; `class` is below the class count.
        unsafe {
            st.pages
                .install(page, class, &self.config, st.key, core::ptr::null());
            Some(st.pages.allocate(class))
        }
    }

    /// Frees a block.
    ///
    /// # Safety
    /// `ptr` must have been returned by this pool's [`allocate`](Self::allocate) for a
    /// layout with the same alignment as `layout` and a size between the one requested and
    /// the one granted, and not freed since. A block of another pool, a layout of another
    /// class, and (in debug builds or with feature `checked`) a double free or an interior
    /// pointer abort the process with a message naming the pool.
    #[inline]
    pub unsafe fn deallocate(&self, ptr: NonNull<u8>, layout: Layout) {
        let class = class_for_free(&self.config, ptr, layout);
        let page = page_of(ptr.as_ptr(), self.config.page_size());
        // SAFETY: `!Sync`, no other borrow is live.
        let st = unsafe { &mut *self.state.get() };
        // SAFETY: for a block of this pool (the caller's contract) the page is a live page of
        // this pool; the checks abort otherwise.
        unsafe {
            check_owner(
                page,
                ptr.as_ptr(),
                class,
                marker(page, st.key),
                &self.config,
            );
            st.bins
                .free(&mut st.pages, page, ptr.as_ptr(), class, &self.config);
        }
        st.frees += 1;
        st.granted -= self.config.class_size(class);
        st.requested = st.requested.wrapping_sub(layout.size());
    }

    /// Returns every page with no live block to the parent.
    pub fn garbage_collect(&self) {
        // SAFETY: `!Sync`; the borrow ends before the parent is called. The bins hold only
        // blocks of this pool's pages.
        unsafe {
            let st = &mut *self.state.get();
            st.bins.flush(&mut st.pages, &self.config);
            st.pages.collect_empty_partials();
        }
        loop {
            // SAFETY: as above.
            let page = unsafe { (*self.state.get()).pages.pop_empty() };
            let Some(page) = page else { break };
            // SAFETY: an empty page was allocated from the parent with the page layout and
            // is in no list any more.
            unsafe {
                self.parent.free_page(
                    NonNull::new_unchecked(page.cast()),
                    self.config.page_layout(),
                );
                (*self.state.get()).held_pages -= 1;
            }
        }
    }

    /// Bytes granted to live blocks: `stats().granted_bytes`, without the rest of the
    /// snapshot (for a budget check on every allocation).
    #[inline]
    pub fn granted_bytes(&self) -> usize {
        // SAFETY: `!Sync`; a shared read that ends before returning.
        unsafe { (*self.state.get()).granted }
    }

    /// A snapshot of the pool's counters (exact: the pool is single-threaded). Gives the
    /// freed blocks waiting for reuse back to their pages first, so `free_pages` counts every
    /// page with no live block but those a class keeps as its last (see
    /// [`PoolStats::free_pages`]).
    pub fn stats(&self) -> PoolStats {
        // SAFETY: `!Sync`; the borrow ends before returning. The bins hold only blocks of
        // this pool's pages.
        let st = unsafe { &mut *self.state.get() };
        // SAFETY: as above.
        unsafe { st.bins.flush(&mut st.pages, &self.config) };
        PoolStats {
            granted_bytes: st.granted,
            requested_bytes: st.requested,
            live_blocks: (st.allocations - st.frees) as usize,
            allocations: st.allocations,
            frees: st.frees,
            peak_granted_bytes: st.peak,
            reserved_bytes: st.held_pages * self.config.page_size(),
            pages: st.held_pages,
            free_pages: st.pages.empty_count(),
            bookkeeping_bytes: 0,
            thread_heaps: 0,
        }
    }

    /// Checks the page lists and that they agree with the counters. Meant for tests.
    pub fn validate(&self) -> Result<(), &'static str> {
        // SAFETY: `!Sync`; a shared read that ends before returning.
        let st = unsafe { &*self.state.get() };
        let cached = st.bins.validate(&self.config)?;
        let (used, pages) = st.pages.validate(&self.config)?;
        // Pages count cached blocks as used.
        if used.checked_sub(cached).map(|live| live as u64) != Some(st.allocations - st.frees) {
            return Err("live slots differ from the block count");
        }
        if pages != st.held_pages {
            return Err("pages in lists differ from pages held");
        }
        Ok(())
    }
}

impl<P: PageParent> Drop for PoolSchema<P> {
    fn drop(&mut self) {
        let st = self.state.get_mut();
        let live = st.allocations - st.frees;
        if live != 0 && cfg!(debug_assertions) {
            let mut text = StackText::<200>::new();
            let _ = writeln!(
                text,
                "tagalloc: pool '{}' dropped with {} live blocks ({} bytes); their memory is \
                 freed",
                self.config.name(),
                live,
                st.granted
            );
            warn(text.as_bytes());
        }
        let layout = self.config.page_layout();
        let parent = &self.parent;
        st.pages.release_all(|page| {
            // SAFETY: every page the pool holds came from the parent with the page layout.
            unsafe { parent.free_page(NonNull::new_unchecked(page.cast()), layout) }
        });
        st.held_pages = 0;
    }
}

#[cfg(test)]
mod tests;
