//! Pool pages and the per-class page lists: the engine shared by [`PoolSchema`] and
//! [`ThreadPoolSchema`].
//!
//! A page is `page_size` bytes aligned to `page_size`, with its [`PageHeader`] at the start,
//! so the header of any block is found by masking the block's address. Slots of the page's
//! class are carved from the page's end: the end is `page_size`-aligned, so a slot whose size
//! is a multiple of `A` is `A`-aligned, which is how aligned requests are served without a
//! second mechanism. Slots are handed out first from a LIFO free list threaded through freed
//! slots, then from a bump pointer over never-used slots, so memory is touched only when it
//! is first used.
//!
//! Each class keeps its pages with free slots (partial) apart from its full pages, both in
//! doubly linked lists, so every transition is O(1) and allocation only looks at the first
//! partial page. (A page that hands out its last slot moves to the full list lazily, when
//! the next allocation finds it exhausted, so the fast path has no fill check.) A page that
//! becomes empty leaves its class (unless it is the class's only partial page, to avoid
//! thrashing at a boundary) and can then serve any class.
//!
//! Nothing here counts bytes or talks to a parent: the schemas do that, and decide where
//! empty pages go.
//!
//! Every header field is accessed through raw pointers (never `&mut PageHeader`): in the
//! thread-pool schema other threads read the immutable fields (`marker`, `class`, `owner`)
//! of a page while its owner updates the others.
//!
//! [`PoolSchema`]: super::PoolSchema
//! [`ThreadPoolSchema`]: crate::schema::thread_pool::ThreadPoolSchema

use super::PoolConfig;
use crate::fatal::fatal;
use core::ptr::null_mut;

/// Whether double frees and interior-pointer frees are checked with a per-page bitmap:
/// always, in every build. A pool block's free sets and tests one bit in its page's header
/// (a line the free touches anyway), so a double free aborts at the second free instead of
/// handing the block out twice; what it costs is in `docs/misuse.md`.
pub(crate) const CHECKED: bool = true;

/// The most size classes a pool can have; the class table is inline in the schema (and in
/// each per-thread heap), so it needs a bound known at compile time.
pub const MAX_CLASSES: usize = 64;

/// `class` of a page that serves no class.
pub(crate) const NO_CLASS: u16 = u16::MAX;

/// Mixed into a page's marker so that a live pool page is told apart from other memory.
const PAGE_MAGIC: usize = 0x9e37_79b9_7f4a_7c15;

/// A free slot's link: the first word of every free slot.
pub(crate) struct FreeSlot {
    pub(crate) next: *mut FreeSlot,
}

/// The header at the start of every pool page.
#[repr(C)]
pub(crate) struct PageHeader {
    /// `marker(page, key)` while the page serves a class; 0 otherwise.
    marker: usize,
    /// LIFO list of freed slots.
    free: *mut FreeSlot,
    /// Next never-used slot; the slots from here to the page end were never handed out.
    bump: *mut u8,
    /// Links in the class's partial or full list, or in a list of empty pages.
    next: *mut PageHeader,
    prev: *mut PageHeader,
    /// The heap owning the page (thread-pool schema only; null in a `PoolSchema`). Stable
    /// while any block of the page is live.
    owner: *const u8,
    /// Slots handed out and not yet freed.
    used: u32,
    /// Slots in the page for its class.
    capacity: u32,
    /// Bytes per slot.
    elem: u32,
    /// Size class, or `NO_CLASS`.
    class: u16,
    /// `log2(min_size)`: the bitmap has one bit per `min_size` bytes of the page.
    shift: u8,
    /// Whether the page is in its class's full list (else partial).
    full: bool,
}

impl PageHeader {
    /// Whether `page` serves `class` now (for validation).
    ///
    /// # Safety
    /// `page` must be a page of a live pool.
    pub(crate) unsafe fn serves(page: *mut Self, class: usize) -> bool {
        // SAFETY: forwarded.
        unsafe { (*page).marker != 0 && (*page).class as usize == class }
    }
}

/// Bytes of the header before the bitmap of checked builds.
pub(crate) const HEADER_FIXED: usize = core::mem::size_of::<PageHeader>().next_multiple_of(8);
const _: () = assert!(HEADER_FIXED <= 128);

/// The key of the pool with unique id `uid`: with a page's address, it gives the marker
/// the page carries while it serves a class ([`marker`]). Computed once per pool.
#[inline]
pub(crate) const fn marker_key(uid: usize) -> usize {
    PAGE_MAGIC ^ uid.wrapping_mul(0xff51_afd7_ed55_8ccd)
}

/// The marker a page of the pool with marker key `key` carries while it serves a class.
#[inline]
pub(crate) fn marker(page: *mut PageHeader, key: usize) -> usize {
    page.addr() ^ key
}

/// The page holding a pool block.
#[inline]
pub(crate) fn page_of(ptr: *mut u8, page_size: usize) -> *mut PageHeader {
    ptr.map_addr(|a| a & !(page_size - 1)).cast()
}

/// The heap that owns a page (thread-pool schema).
///
/// # Safety
/// `page` must be a live pool page with a live block in it.
#[inline]
pub(crate) unsafe fn owner_of(page: *mut PageHeader) -> *const u8 {
    // SAFETY: forwarded; the owner is stable while a block is live.
    unsafe { (*page).owner }
}

/// Aborts unless `ptr` can be a live block of `class` in a page carrying `expected` as its
/// marker. Reads only the fields that are stable while a block is live, so any thread may
/// call it.
///
/// # Safety
/// `page` must be readable for a header (true when `ptr` is any block of any pool page; a
/// pointer from elsewhere breaks the caller's contract).
#[inline]
pub(crate) unsafe fn check_owner(
    page: *mut PageHeader,
    ptr: *mut u8,
    class: usize,
    expected: usize,
    cfg: &PoolConfig,
) {
    // SAFETY: forwarded from the caller.
    let (m, c) = unsafe { ((*page).marker, (*page).class) };
    if m != expected || c as usize != class {
        report_bad_owner(page, ptr, class, expected, cfg);
    }
}

#[cold]
#[inline(never)]
fn report_bad_owner(
    page: *mut PageHeader,
    ptr: *mut u8,
    class: usize,
    expected: usize,
    cfg: &PoolConfig,
) -> ! {
    // SAFETY: only reached after the caller read this header.
    let (m, c) = unsafe { ((*page).marker, (*page).class) };
    if m != expected {
        fatal!(
            "pool '{}': free of {:p}, which is not a live block of this pool (wrong \
             allocator, or its page was already freed)",
            cfg.name(),
            ptr
        );
    }
    fatal!(
        "pool '{}': free of {:p} with a layout of the {}-byte class, but the block is in the \
         {}-byte class (the layout passed to free differs from the one allocated)",
        cfg.name(),
        ptr,
        cfg.class_size(class),
        cfg.class_size(c as usize)
    )
}

/// A page's bitmap word holding the "live" bit of `slot`, and the bit.
///
/// # Safety
/// `page` must be a formatted page of a checked build and `slot` a pointer into it.
#[inline]
unsafe fn live_bit(page: *mut PageHeader, slot: *mut u8) -> (*mut u64, u64) {
    // SAFETY: the header is valid; the bitmap follows it and has a bit for every
    // `min_size` bytes of the page.
    unsafe {
        let index = (slot.addr() - page.addr()) >> (*page).shift;
        let word = page.byte_add(HEADER_FIXED).cast::<u64>().add(index / 64);
        (word, 1u64 << (index % 64))
    }
}

/// Aborts unless `slot` is the start of a live slot of `page`, and marks it free in the
/// bitmap (every build).
///
/// Slots start on multiples of the page's smallest class from the page's end, and only slot
/// starts ever have their bit set, so the fast test is a mask and one bit: a pointer off that
/// grid, or whose bit is clear (never handed out, already freed, inside a slot), goes to
/// [`report_bad_pool_free`], which tells them apart.
///
/// # Safety
/// `page` must be a formatted page and `slot` a pointer into it.
#[inline]
pub(crate) unsafe fn check_live_and_clear(page: *mut PageHeader, slot: *mut u8, cfg: &PoolConfig) {
    // SAFETY: forwarded from the caller.
    unsafe {
        let grid = (1usize << (*page).shift) - 1;
        let (word, bit) = live_bit(page, slot);
        if slot.addr() & grid != 0 || *word & bit == 0 {
            report_bad_pool_free(page, slot, cfg);
        }
        *word &= !bit;
    }
}

/// The diagnosis of a pool free that [`check_live_and_clear`] refused.
///
/// # Safety
/// As for [`check_live_and_clear`].
#[cold]
#[inline(never)]
unsafe fn report_bad_pool_free(page: *mut PageHeader, slot: *mut u8, cfg: &PoolConfig) -> ! {
    // SAFETY: forwarded from the caller: the header is valid.
    let (elem, capacity) = unsafe { ((*page).elem as usize, (*page).capacity as usize) };
    let end = page.addr() + cfg.page_size();
    let first = end - capacity * elem;
    if slot.addr() < first || (end - slot.addr()) % elem != 0 {
        fatal!(
            "pool '{}': free of {:p}, which is inside a {}-byte block, not at its start",
            cfg.name(),
            slot,
            elem
        );
    }
    fatal!(
        "pool '{}': double free of {:p} ({}-byte block)",
        cfg.name(),
        slot,
        elem
    )
}

/// Pushes a freed slot on its page's free list (the caller updates `used`).
///
/// # Safety
/// `page` must be a formatted page and `slot` one of its slots, no longer live.
#[inline(always)]
unsafe fn push_free(page: *mut PageHeader, slot: *mut u8) {
    let s: *mut FreeSlot = slot.cast();
    // SAFETY: the slot is free, so its first word is the list link; the header is valid.
    unsafe {
        (*s).next = (*page).free;
        (*page).free = s;
    }
}

/// Checked builds: marks a slot being handed out as live.
///
/// # Safety
/// `page` must be a formatted page of a checked build and `slot` one of its slots.
#[inline]
pub(crate) unsafe fn mark_live(page: *mut PageHeader, slot: *mut u8) {
    // SAFETY: forwarded.
    unsafe {
        let (word, bit) = live_bit(page, slot);
        *word |= bit;
    }
}

/// A stack of pages serving no class, linked through their `next` field.
pub(crate) struct EmptyList {
    head: *mut PageHeader,
    count: usize,
}

impl EmptyList {
    pub(crate) const fn new() -> Self {
        Self {
            head: null_mut(),
            count: 0,
        }
    }

    /// Pushes a page, marking it as serving no class.
    ///
    /// # Safety
    /// `page` must be a page-sized, page-aligned block owned by the list's owner, in no list.
    #[inline]
    pub(crate) unsafe fn push(&mut self, page: *mut PageHeader) {
        // SAFETY: the page is ours; only `next` is used while it is empty.
        unsafe {
            (*page).marker = 0;
            (*page).class = NO_CLASS;
            (*page).owner = core::ptr::null();
            (*page).next = self.head;
        }
        self.head = page;
        self.count += 1;
    }

    /// Takes a page, if any.
    #[inline]
    pub(crate) fn pop(&mut self) -> Option<*mut PageHeader> {
        let page = self.head;
        if page.is_null() {
            return None;
        }
        // SAFETY: pages in the list are valid.
        self.head = unsafe { (*page).next };
        self.count -= 1;
        Some(page)
    }

    /// Pages in the list.
    #[inline]
    pub(crate) fn len(&self) -> usize {
        self.count
    }

    /// Checks that the count matches the links and every page serves no class.
    pub(crate) fn validate(&self) -> Result<usize, &'static str> {
        let mut page = self.head;
        let mut n = 0;
        while !page.is_null() {
            // SAFETY: listed pages are valid.
            unsafe {
                if (*page).class != NO_CLASS {
                    return Err("empty page still has a class");
                }
                page = (*page).next;
            }
            n += 1;
        }
        if n != self.count {
            return Err("empty count is wrong");
        }
        Ok(n)
    }
}

/// A class's pages.
#[derive(Clone, Copy)]
struct ClassLists {
    partial: *mut PageHeader,
    full: *mut PageHeader,
}

/// Pages of one heap: per-class partial and full lists, and a list of empty pages.
pub(crate) struct Pages {
    classes: [ClassLists; MAX_CLASSES],
    /// Pages serving no class.
    empty: EmptyList,
}

/// Unlinks `page` from the doubly linked list whose head is `*head`.
///
/// # Safety
/// `page` must be in that list; all pages in it are valid.
#[inline]
unsafe fn unlink(head: &mut *mut PageHeader, page: *mut PageHeader) {
    // SAFETY: `page` and its neighbours are valid headers of the list.
    unsafe {
        let (prev, next) = ((*page).prev, (*page).next);
        if prev.is_null() {
            *head = next;
        } else {
            (*prev).next = next;
        }
        if !next.is_null() {
            (*next).prev = prev;
        }
    }
}

/// Pushes `page` at the front of the doubly linked list whose head is `*head`.
///
/// # Safety
/// `page` must be valid and in no list; all pages in the list are valid.
#[inline]
unsafe fn push_front(head: &mut *mut PageHeader, page: *mut PageHeader) {
    // SAFETY: `page` and the current head are valid headers.
    unsafe {
        (*page).prev = null_mut();
        (*page).next = *head;
        if !head.is_null() {
            (**head).prev = page;
        }
    }
    *head = page;
}

impl Pages {
    pub(crate) const fn new() -> Self {
        Self {
            classes: [ClassLists {
                partial: null_mut(),
                full: null_mut(),
            }; MAX_CLASSES],
            empty: EmptyList::new(),
        }
    }

    /// Takes a slot from the class's first partial page; null when the class has none.
    ///
    /// The fast path pops the first page's free list and nothing else. A page that hands out
    /// its last slot stays at the front of the partial list until the next allocation finds
    /// it exhausted and moves it to the full list ([`allocate_slow`](Self::allocate_slow)),
    /// so the common case has no fill check.
    ///
    /// # Safety
    /// `class` must be below the configuration's class count; the heap's pages are valid.
    #[inline]
    pub(crate) unsafe fn allocate(&mut self, class: usize) -> *mut u8 {
        let page = self.classes[class].partial;
        if page.is_null() {
            return null_mut();
        }
        // SAFETY: pages in a partial list are valid and formatted; a non-null free list holds
        // free slots of the page.
        unsafe {
            let free = (*page).free;
            if free.is_null() {
                return self.allocate_slow(class);
            }
            (*page).free = (*free).next;
            (*page).used += 1;
            let slot: *mut u8 = free.cast();
            if CHECKED {
                mark_live(page, slot);
            }
            slot
        }
    }

    /// The allocation path past an empty free list: takes a never-used slot of the first
    /// partial page, moving exhausted pages to the full list on the way; null when the class
    /// has no page with a free slot.
    ///
    /// # Safety
    /// As for [`allocate`](Self::allocate).
    #[inline(never)]
    unsafe fn allocate_slow(&mut self, class: usize) -> *mut u8 {
        loop {
            let page = self.classes[class].partial;
            if page.is_null() {
                return null_mut();
            }
            // With no slot in its list and `used < capacity`, a page has never-used slots
            // from `bump` on (used + listed + never-used = capacity).
            // SAFETY: pages in a partial list are valid and formatted.
            unsafe {
                let free = (*page).free;
                let slot: *mut u8 = if !free.is_null() {
                    (*page).free = (*free).next;
                    free.cast()
                } else if (*page).used < (*page).capacity {
                    let s = (*page).bump;
                    (*page).bump = s.add((*page).elem as usize);
                    s
                } else {
                    let lists = &mut self.classes[class];
                    unlink(&mut lists.partial, page);
                    push_front(&mut lists.full, page);
                    (*page).full = true;
                    continue;
                };
                (*page).used += 1;
                if CHECKED {
                    mark_live(page, slot);
                }
                return slot;
            }
        }
    }

    /// Formats a page for `class` and puts it at the front of the class's partial list.
    ///
    /// # Safety
    /// `page` must be `cfg.page_size()` bytes aligned to it, owned by this heap, and in no
    /// list; `class` must be below the class count.
    pub(crate) unsafe fn install(
        &mut self,
        page: *mut PageHeader,
        class: usize,
        cfg: &PoolConfig,
        key: usize,
        owner: *const u8,
    ) {
        let elem = cfg.class_size(class);
        let page_size = cfg.page_size();
        let capacity = (page_size - cfg.header_size()) / elem;
        debug_assert!(capacity >= 2);
        // SAFETY: the page is ours and `page_size` bytes long; the header and bitmap fit in
        // `header_size` bytes, below the first slot.
        unsafe {
            page.write(PageHeader {
                marker: marker(page, key),
                free: null_mut(),
                bump: page.cast::<u8>().add(page_size - capacity * elem),
                next: null_mut(),
                prev: null_mut(),
                owner,
                used: 0,
                capacity: capacity as u32,
                elem: elem as u32,
                class: class as u16,
                shift: cfg.min_size().trailing_zeros() as u8,
                full: false,
            });
            if CHECKED {
                page.byte_add(HEADER_FIXED)
                    .cast::<u64>()
                    .write_bytes(0, cfg.bitmap_words());
            }
            push_front(&mut self.classes[class].partial, page);
        }
    }

    /// Returns a slot to its page. Returns `true` when the page became empty and left its
    /// class: the caller then owns the empty page (to keep with [`push_empty`](Self::push_empty)
    /// or give back).
    ///
    /// Checks, in checked builds, that `slot` is the start of a live slot; in all builds,
    /// that the page has a live slot at all.
    ///
    /// # Safety
    /// `page` must be a page of this heap that passed [`check_owner`] for `slot`.
    #[inline]
    pub(crate) unsafe fn free(
        &mut self,
        page: *mut PageHeader,
        slot: *mut u8,
        cfg: &PoolConfig,
    ) -> bool {
        // SAFETY: forwarded from the caller.
        unsafe {
            if CHECKED {
                check_live_and_clear(page, slot, cfg);
            }
            self.release(page, slot, cfg)
        }
    }

    /// [`free`](Self::free) of a slot whose checked-build bit is already clear: a block that
    /// waited in a schema's [`Bins`](super::bins::Bins).
    ///
    /// # Safety
    /// As for [`free`](Self::free); in checked builds the slot's live bit must have been
    /// cleared by [`check_live_and_clear`].
    #[inline]
    pub(crate) unsafe fn release(
        &mut self,
        page: *mut PageHeader,
        slot: *mut u8,
        cfg: &PoolConfig,
    ) -> bool {
        // SAFETY: the page is a formatted page of this heap; `slot` points into it.
        unsafe {
            let used = (*page).used;
            if !(*page).full {
                // Stays in its list: it keeps live blocks, or it is its class's only
                // partial page (an alloc+free pair in a quiet class).
                if used > 1
                    || (used == 1 && {
                        let lists = &self.classes[(*page).class as usize];
                        lists.partial == page && (*page).next.is_null()
                    })
                {
                    push_free(page, slot);
                    (*page).used = used - 1;
                    return false;
                }
            }
            self.free_moving(page, slot, cfg)
        }
    }

    /// Frees every slot of a list linked through their first words (remote frees, or a bin's
    /// blocks). Pages that become empty join the empty list; returns how many did.
    /// `live_bits_clear` says whether checked builds already cleared the slots' live bits
    /// (blocks from a bin) or must check and clear them now.
    ///
    /// # Safety
    /// Every slot of the list must be a live (or, with `live_bits_clear`, binned) slot of a
    /// page of this heap that passed [`check_owner`].
    pub(crate) unsafe fn free_list(
        &mut self,
        mut s: *mut FreeSlot,
        cfg: &PoolConfig,
        live_bits_clear: bool,
    ) -> usize {
        let mut emptied = 0;
        while !s.is_null() {
            // SAFETY: forwarded; the link is read before the slot goes back to its page.
            unsafe {
                let next = (*s).next;
                let slot: *mut u8 = s.cast();
                let page = page_of(slot, cfg.page_size());
                if CHECKED && !live_bits_clear {
                    check_live_and_clear(page, slot, cfg);
                }
                if self.release(page, slot, cfg) {
                    self.push_empty(page);
                    emptied += 1;
                }
                s = next;
            }
        }
        emptied
    }

    /// [`free`](Self::free) of a block whose page changes list: out of the full list, or out
    /// of its class once empty (unless it is the class's only partial page, to avoid
    /// thrashing at a boundary). Also where a free in a page with no live block ends.
    ///
    /// # Safety
    /// As for [`free`](Self::free), with the checked-build bitmap already updated.
    #[inline(never)]
    unsafe fn free_moving(
        &mut self,
        page: *mut PageHeader,
        slot: *mut u8,
        cfg: &PoolConfig,
    ) -> bool {
        // SAFETY: the page is a formatted page of this heap; `slot` points into it.
        unsafe {
            if (*page).used == 0 {
                fatal!(
                    "pool '{}': free of {:p} in a page with no live block (double free)",
                    cfg.name(),
                    slot
                );
            }
            push_free(page, slot);
            (*page).used -= 1;
            let class = (*page).class as usize;
            let lists = &mut self.classes[class];
            if (*page).full {
                unlink(&mut lists.full, page);
                push_front(&mut lists.partial, page);
                (*page).full = false;
            }
            if (*page).used == 0 && !(lists.partial == page && (*page).next.is_null()) {
                unlink(&mut lists.partial, page);
                Self::retire(page);
                return true;
            }
            false
        }
    }

    /// Marks a page as serving no class.
    ///
    /// # Safety
    /// `page` must be a valid header in no list.
    #[inline]
    unsafe fn retire(page: *mut PageHeader) {
        // SAFETY: forwarded.
        unsafe {
            (*page).marker = 0;
            (*page).class = NO_CLASS;
            (*page).owner = core::ptr::null();
        }
    }

    /// Keeps an empty page (from [`free`](Self::free), or fresh) for later reuse.
    ///
    /// # Safety
    /// `page` must be a page-sized, page-aligned block owned by this heap, in no list.
    #[inline]
    pub(crate) unsafe fn push_empty(&mut self, page: *mut PageHeader) {
        // SAFETY: forwarded.
        unsafe { self.empty.push(page) }
    }

    /// Takes an empty page, if the heap keeps one.
    #[inline]
    pub(crate) fn pop_empty(&mut self) -> Option<*mut PageHeader> {
        self.empty.pop()
    }

    /// How many empty pages the heap keeps.
    #[inline]
    pub(crate) fn empty_count(&self) -> usize {
        self.empty.len()
    }

    /// Moves the empty pages still serving a class (each class keeps its last partial page
    /// even when empty) to the empty list. Returns how many moved.
    pub(crate) fn collect_empty_partials(&mut self) -> usize {
        let mut moved = 0;
        for c in 0..MAX_CLASSES {
            let mut page = self.classes[c].partial;
            // SAFETY: pages in a partial list are valid headers of this heap.
            unsafe {
                while !page.is_null() {
                    let next = (*page).next;
                    if (*page).used == 0 {
                        unlink(&mut self.classes[c].partial, page);
                        Self::retire(page);
                        self.push_empty(page);
                        moved += 1;
                    }
                    page = next;
                }
            }
        }
        moved
    }

    /// Empties the heap, calling `f` on every page it holds (partial, full and empty).
    pub(crate) fn release_all(&mut self, mut f: impl FnMut(*mut PageHeader)) {
        for c in 0..MAX_CLASSES {
            for head in [self.classes[c].partial, self.classes[c].full] {
                let mut page = head;
                while !page.is_null() {
                    // SAFETY: listed pages are valid until `f` frees them; `next` is read first.
                    let next = unsafe { (*page).next };
                    f(page);
                    page = next;
                }
            }
        }
        while let Some(page) = self.pop_empty() {
            f(page);
        }
        *self = Self::new();
    }

    /// Checks the lists' invariants; returns the number of live slots and of pages held.
    pub(crate) fn validate(&self, cfg: &PoolConfig) -> Result<(usize, usize), &'static str> {
        let mut live = 0;
        let mut pages = 0;
        for c in 0..MAX_CLASSES {
            for (head, full) in [
                (self.classes[c].partial, false),
                (self.classes[c].full, true),
            ] {
                let mut page = head;
                let mut prev = null_mut();
                // SAFETY: listed pages are valid headers of this heap.
                unsafe {
                    while !page.is_null() {
                        if c >= cfg.class_count() || (*page).class as usize != c {
                            return Err("page in the wrong class list");
                        }
                        if (*page).prev != prev {
                            return Err("broken back link");
                        }
                        // A page that handed out its last slot waits in the partial list
                        // until an allocation finds it exhausted, so only full pages have a
                        // fill to check.
                        if (*page).full != full || (full && (*page).used != (*page).capacity) {
                            return Err("page in the wrong list for its fill");
                        }
                        if (*page).elem as usize != cfg.class_size(c) {
                            return Err("page slot size does not match its class");
                        }
                        let mut n = 0;
                        let mut s = (*page).free;
                        while !s.is_null() {
                            n += 1;
                            if n > (*page).capacity {
                                return Err("free list longer than the page");
                            }
                            s = (*s).next;
                        }
                        let end = page.addr() + cfg.page_size();
                        let untouched = (end - (*page).bump.addr()) / (*page).elem as usize;
                        if (*page).used + n + untouched as u32 != (*page).capacity {
                            return Err("slots do not add up");
                        }
                        live += (*page).used as usize;
                        pages += 1;
                        prev = page;
                        page = (*page).next;
                    }
                }
            }
        }
        let n = self.empty.validate()?;
        Ok((live, pages + n))
    }
}
