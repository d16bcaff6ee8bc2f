//! Per-class caches of freed blocks in front of a pool's pages.
//!
//! A block freed into a pool first waits in its class's [`Bin`], a LIFO list in the schema's
//! own state, and the next allocation of that class takes it back from there without
//! touching any page. This keeps the alloc+free pair off the page header, whose free list
//! and fill count would otherwise be read and written in a chain by every pair (store to
//! load forwarding on each step). The pages still count a cached block as used; a bin that
//! grows past its limit gives its colder half back to the pages, and the schema flushes all
//! bins whenever a page with no live block matters: before asking the parent for a page,
//! on collection, and when statistics or validation are read. So an emptied page still
//! serves other classes before the pool grows, and the figures stay those of a pool with no
//! cache.
//!
//! In checked builds a block's live bit is cleared when it enters a bin and set again when
//! it leaves, so double frees are still caught at once.

use super::PoolConfig;
use super::page::{
    CHECKED, FreeSlot, MAX_CLASSES, PageHeader, Pages, check_live_and_clear, mark_live, page_of,
};
use core::ptr::null_mut;

/// The most blocks a bin holds before giving half back.
const MAX_BIN_BLOCKS: usize = 64;
/// The fewest (for the largest classes). At least 2, so a trim keeps at least one block.
const MIN_BIN_BLOCKS: usize = 8;
const _: () = assert!(MIN_BIN_BLOCKS >= 2);
/// The bytes a bin may hold, within those counts: enough for a batch of 64 blocks of up to
/// 256 bytes to run from the bin alone.
const BIN_BYTES: usize = 16 * 1024;

/// One class's cached blocks.
#[derive(Clone, Copy)]
struct Bin {
    head: *mut FreeSlot,
    count: u32,
    /// The count above which the bin gives its colder half back to the pages.
    limit: u32,
}

/// The bins of one pool (or one thread's heap of a thread pool).
pub(crate) struct Bins {
    bins: [Bin; MAX_CLASSES],
}

impl Bins {
    /// Empty bins sized for `cfg`: each holds up to [`BIN_BYTES`] of its blocks, and
    /// between [`MIN_BIN_BLOCKS`] and [`MAX_BIN_BLOCKS`] blocks. Held blocks never make the
    /// pool grow (they are given back before the parent is asked for a page); they only keep
    /// pages from being returned until a collection.
    pub(crate) const fn new(cfg: &PoolConfig) -> Self {
        let mut bins = [Bin {
            head: null_mut(),
            count: 0,
            limit: 0,
        }; MAX_CLASSES];
        let mut class = 0;
        while class < cfg.class_count() {
            let fits = BIN_BYTES / cfg.class_size(class);
            let limit = if fits > MAX_BIN_BLOCKS {
                MAX_BIN_BLOCKS
            } else if fits < MIN_BIN_BLOCKS {
                MIN_BIN_BLOCKS
            } else {
                fits
            };
            bins[class].limit = limit as u32;
            class += 1;
        }
        Self { bins }
    }

    /// Takes a block of `class`: the last one freed into its bin, else one from the class's
    /// pages; null when neither has one.
    ///
    /// # Safety
    /// `class` must be below the configuration's class count; `pages` must be the pages the
    /// bins' blocks belong to.
    #[inline]
    pub(crate) unsafe fn allocate(
        &mut self,
        pages: &mut Pages,
        class: usize,
        cfg: &PoolConfig,
    ) -> *mut u8 {
        // SAFETY: the caller keeps `class` in range.
        let bin = unsafe { self.bins.get_unchecked_mut(class) };
        let head = bin.head;
        if head.is_null() {
            // SAFETY: forwarded.
            return unsafe { pages.allocate(class) };
        }
        // SAFETY: a cached block is a free slot whose first word links the bin, in a
        // formatted page of this pool.
        unsafe {
            bin.head = (*head).next;
            bin.count -= 1;
            if CHECKED {
                mark_live(page_of(head.cast(), cfg.page_size()), head.cast());
            }
        }
        head.cast()
    }

    /// Frees a block of `class` into its bin, giving the bin's older half back to the pages
    /// when it is over its limit. Checked builds first abort on a double free or an
    /// interior pointer. Returns how many pages became empty (now in `pages`' empty list).
    ///
    /// # Safety
    /// `slot` must be a live block of `class` in `page`, a page of `pages` that passed
    /// [`check_owner`](super::page::check_owner); `class` below the class count.
    #[inline]
    pub(crate) unsafe fn free(
        &mut self,
        pages: &mut Pages,
        page: *mut PageHeader,
        slot: *mut u8,
        class: usize,
        cfg: &PoolConfig,
    ) -> usize {
        if CHECKED {
            // SAFETY: forwarded.
            unsafe { check_live_and_clear(page, slot, cfg) };
        }
        // SAFETY: the caller keeps `class` in range.
        let bin = unsafe { self.bins.get_unchecked_mut(class) };
        let s: *mut FreeSlot = slot.cast();
        // SAFETY: the block is free now and at least a pointer long (min_size >= a pointer).
        unsafe { (*s).next = bin.head };
        bin.head = s;
        bin.count += 1;
        if bin.count > bin.limit {
            // SAFETY: forwarded.
            unsafe { self.trim(class, pages, cfg) }
        } else {
            0
        }
    }

    /// Gives the blocks of `class` beyond half its limit back to their pages (the older
    /// ones, at the end of the list). Returns the number of pages that became empty, which
    /// are in `pages`' empty list.
    ///
    /// # Safety
    /// Every cached block must belong to `pages`.
    #[cold]
    #[inline(never)]
    unsafe fn trim(&mut self, class: usize, pages: &mut Pages, cfg: &PoolConfig) -> usize {
        let bin = &mut self.bins[class];
        let keep = bin.limit / 2;
        // SAFETY: the bin holds more than `keep` >= 1 blocks (limits are at least
        // MIN_BIN_BLOCKS), all linked free slots of `pages` with their live bits clear.
        unsafe {
            let mut last = bin.head;
            for _ in 1..keep {
                last = (*last).next;
            }
            let rest = (*last).next;
            (*last).next = null_mut();
            bin.count = keep;
            pages.free_list(rest, cfg, true)
        }
    }

    /// Gives every cached block back to its page. Returns the number of pages that became
    /// empty, which are in `pages`' empty list.
    ///
    /// # Safety
    /// Every cached block must belong to `pages`.
    pub(crate) unsafe fn flush(&mut self, pages: &mut Pages, cfg: &PoolConfig) -> usize {
        let mut emptied = 0;
        for bin in &mut self.bins[..cfg.class_count()] {
            if bin.count == 0 {
                continue;
            }
            let list = core::mem::replace(&mut bin.head, null_mut());
            bin.count = 0;
            // SAFETY: forwarded; binned blocks have their live bits clear.
            emptied += unsafe { pages.free_list(list, cfg, true) };
        }
        emptied
    }

    /// Checks each bin's count against its list, and that every cached block sits in a
    /// page serving its class. Returns the number of cached blocks.
    pub(crate) fn validate(&self, cfg: &PoolConfig) -> Result<usize, &'static str> {
        let mut total = 0;
        for (class, bin) in self.bins.iter().enumerate() {
            let mut n = 0;
            let mut s = bin.head;
            while !s.is_null() {
                n += 1;
                if n > bin.count {
                    return Err("bin list longer than its count");
                }
                let page = page_of(s.cast(), cfg.page_size());
                // SAFETY: cached blocks are free slots of live pages of this pool.
                unsafe {
                    if !PageHeader::serves(page, class) {
                        return Err("cached block in a page of another class");
                    }
                    s = (*s).next;
                }
            }
            if n != bin.count {
                return Err("bin count differs from its list");
            }
            total += n as usize;
        }
        Ok(total)
    }
}
