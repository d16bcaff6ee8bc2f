//! Unit tests of the pool schema on `std::alloc::System` pages, so they also run under Miri.

use super::*;
use std::alloc::System;
use std::sync::atomic::AtomicUsize;

/// A parent that counts the pages it has handed out and can be told to refuse.
#[derive(Default)]
struct CountingParent {
    live: AtomicUsize,
    calls: AtomicUsize,
    refuse: core::sync::atomic::AtomicBool,
}

// SAFETY: forwards to `System`, which keeps the contract.
unsafe impl PageParent for CountingParent {
    fn allocate_page(&self, layout: Layout) -> Option<NonNull<u8>> {
        if self.refuse.load(Ordering::Relaxed) {
            return None;
        }
        let p = System.allocate_page(layout)?;
        self.live.fetch_add(1, Ordering::Relaxed);
        self.calls.fetch_add(1, Ordering::Relaxed);
        Some(p)
    }

    unsafe fn free_page(&self, ptr: NonNull<u8>, layout: Layout) {
        self.live.fetch_sub(1, Ordering::Relaxed);
        // SAFETY: forwarded.
        unsafe { System.free_page(ptr, layout) }
    }
}

fn layout(size: usize, align: usize) -> Layout {
    Layout::from_size_align(size, align).unwrap()
}

fn fill(a: Allocation, len: usize, seed: u8) {
    for i in 0..len {
        // SAFETY: `a` is a live block of at least `len` bytes.
        unsafe { a.ptr.as_ptr().add(i).write(seed.wrapping_add(i as u8)) };
    }
}

fn check(a: Allocation, len: usize, seed: u8) {
    for i in 0..len {
        // SAFETY: `a` is a live block of at least `len` bytes.
        let b = unsafe { *a.ptr.as_ptr().add(i) };
        assert_eq!(b, seed.wrapping_add(i as u8), "byte {i} of {:p}", a.ptr);
    }
}

#[test]
fn miri_config_validation_names_each_error() {
    use PoolConfigError::*;
    assert_eq!(
        PoolConfig::new(4096, 12, 48),
        Err(MinSizeNotPowerOfTwo { min_size: 12 })
    );
    assert_eq!(
        PoolConfig::new(4096, 4, 64),
        Err(MinSizeTooSmall {
            min_size: 4,
            smallest: 8
        })
    );
    assert_eq!(
        PoolConfig::new(4096, 16, 8),
        Err(MaxSizeBelowMin {
            min_size: 16,
            max_size: 8
        })
    );
    assert_eq!(
        PoolConfig::new(4096, 16, 40),
        Err(MaxSizeNotMultipleOfMin {
            min_size: 16,
            max_size: 40
        })
    );
    assert_eq!(
        PoolConfig::new(1 << 16, 8, 8 * 65),
        Err(TooManyClasses {
            classes: 65,
            limit: 64
        })
    );
    assert_eq!(
        PoolConfig::new(3000, 8, 512),
        Err(PageSizeNotPowerOfTwo { page_size: 3000 })
    );
    assert_eq!(
        PoolConfig::new(1024, 8, 512),
        Err(PageSizeTooSmall {
            page_size: 1024,
            needed: 2048
        })
    );
    assert_eq!(
        PoolConfig::new(512, 8, 64),
        Err(PageSizeTooSmall {
            page_size: 512,
            needed: 1024
        })
    );
    assert_eq!(
        PoolConfig::new(1 << 25, 8, 512),
        Err(PageSizeTooLarge {
            page_size: 1 << 25,
            limit: 1 << 24
        })
    );
    // Every error explains itself.
    assert!(
        PoolConfig::new(1024, 8, 512)
            .unwrap_err()
            .to_string()
            .contains("2048")
    );

    let d = PoolConfig::DEFAULT;
    assert_eq!(
        (d.page_size(), d.min_size(), d.max_size(), d.class_count()),
        (4096, 8, 512, 64)
    );
    assert_eq!(d.max_align(), 512);
    let odd = PoolConfig::new(4096, 8, 24).unwrap();
    assert_eq!(odd.max_align(), 16);
    // A single-class pool is allowed (min == max).
    assert_eq!(PoolConfig::new(1024, 32, 32).unwrap().class_count(), 1);
}

#[test]
fn miri_every_class_fits_at_least_three_blocks_per_page() {
    for (page, min, max) in [
        (1024, 8, 8),
        (1024, 8, 256),
        (1024, 64, 256),
        (4096, 8, 512),
        (8192, 16, 1024),
        (1 << 16, 256, 16384),
    ] {
        let cfg = PoolConfig::new(page, min, max).unwrap();
        for c in 0..cfg.class_count() {
            let cap = (page - cfg.header_size()) / cfg.class_size(c);
            assert!(cap >= 3, "{page}/{min}/{max} class {c} holds {cap}");
        }
    }
}

#[test]
fn miri_block_sizes_round_to_min_and_alignment() {
    let cfg = PoolConfig::DEFAULT;
    assert_eq!(cfg.block_size(layout(0, 1)), Some(8));
    assert_eq!(cfg.block_size(layout(1, 1)), Some(8));
    assert_eq!(cfg.block_size(layout(9, 8)), Some(16));
    assert_eq!(cfg.block_size(layout(9, 32)), Some(32));
    assert_eq!(cfg.block_size(layout(512, 8)), Some(512));
    assert_eq!(cfg.block_size(layout(1, 512)), Some(512));
    assert_eq!(cfg.block_size(layout(1, 1024)), None);
    assert_eq!(cfg.block_size(layout(513, 1)), None);
    assert_eq!(cfg.block_size(layout(300, 512)), Some(512));
    assert_eq!(cfg.block_size(layout(257, 256)), Some(512));
    let custom = PoolConfig::new(1024, 64, 256).unwrap();
    assert_eq!(custom.block_size(layout(1, 1)), Some(64));
    assert_eq!(custom.block_size(layout(65, 1)), Some(128));
}

#[test]
fn miri_round_trip_keeps_contents_and_counters_return_to_zero() {
    let pool = PoolSchema::new(System);
    let n = if cfg!(miri) { 40 } else { 400 };
    let mut live = Vec::new();
    let mut requested = 0;
    let mut granted = 0;
    for i in 0..n {
        let size = (i * 37) % 513;
        let l = layout(size, 1 << (i % 4));
        let a = pool.allocate(l).unwrap();
        assert_eq!(a.size, pool.config().block_size(l).unwrap());
        fill(a, size, i as u8);
        requested += size;
        granted += a.size;
        live.push((a, l, i as u8));
    }
    let st = pool.stats();
    assert_eq!(st.live_blocks, n);
    assert_eq!(st.granted_bytes, granted);
    assert_eq!(st.requested_bytes, requested);
    assert_eq!(st.peak_granted_bytes, granted);
    assert_eq!(st.reserved_bytes, st.pages * 4096);
    pool.validate().unwrap();
    // Free every other block, then the rest, checking contents each time.
    for (a, l, seed) in live.iter().step_by(2) {
        check(*a, l.size(), *seed);
        // SAFETY: allocated above with `l`, freed once.
        unsafe { pool.deallocate(a.ptr, *l) };
    }
    pool.validate().unwrap();
    for (a, l, seed) in live.iter().skip(1).step_by(2) {
        check(*a, l.size(), *seed);
        // SAFETY: as above.
        unsafe { pool.deallocate(a.ptr, *l) };
    }
    let st = pool.stats();
    assert_eq!(
        (st.live_blocks, st.granted_bytes, st.requested_bytes),
        (0, 0, 0)
    );
    assert_eq!((st.allocations, st.frees), (n as u64, n as u64));
    assert_eq!(st.peak_granted_bytes, granted);
    pool.validate().unwrap();
}

#[test]
fn miri_alignments_up_to_max_align_are_honoured() {
    let pool = PoolSchema::new(System);
    let mut live = Vec::new();
    for align_log in 0..=9 {
        let align = 1usize << align_log;
        for size in [0, 1, 7, 8, 100, 512] {
            let l = layout(size, align);
            match pool.allocate(l) {
                Some(a) => {
                    assert_eq!(
                        a.ptr.as_ptr().addr() % align,
                        0,
                        "size {size} align {align}"
                    );
                    assert!(a.size >= size);
                    live.push((a, l));
                }
                None => assert!(size.next_multiple_of(align.max(8)) > 512),
            }
        }
    }
    for (a, l) in live {
        // SAFETY: allocated above with `l`.
        unsafe { pool.deallocate(a.ptr, l) };
    }
    pool.validate().unwrap();
}

#[test]
fn miri_out_of_range_requests_get_none_and_change_nothing() {
    let parent = CountingParent::default();
    let pool = PoolSchema::with_config(&parent, PoolConfig::DEFAULT.with_name("refusals"));
    crate::messages::capture::start();
    for l in [
        layout(513, 1),
        layout(1, 1024),
        layout(4096, 4096),
        layout(1, 2048),
    ] {
        assert!(pool.allocate(l).is_none(), "{l:?}");
    }
    // The first refusal is noted with the pool's name and range, the others not.
    #[cfg(not(miri))]
    {
        use crate::messages::capture::captured;
        assert!(captured(
            "tagalloc: pool 'refusals': request of 513 bytes aligned to 1 refused: this pool \
             serves 8..=512 bytes with alignment up to 512"
        ));
        assert!(!captured(
            "pool 'refusals': request of 1 bytes aligned to 1024"
        ));
    }
    assert_eq!(pool.stats(), PoolStats::default());
    assert_eq!(parent.calls.load(Ordering::Relaxed), 0);
}

#[test]
fn miri_parent_out_of_memory_gives_none_then_recovers() {
    let parent = CountingParent::default();
    let pool = PoolSchema::new(&parent);
    parent.refuse.store(true, Ordering::Relaxed);
    assert!(pool.allocate(layout(64, 8)).is_none());
    assert_eq!(pool.stats(), PoolStats::default());
    parent.refuse.store(false, Ordering::Relaxed);
    let a = pool.allocate(layout(64, 8)).unwrap();
    // SAFETY: allocated above.
    unsafe { pool.deallocate(a.ptr, layout(64, 8)) };
    pool.validate().unwrap();
}

#[test]
fn miri_empty_pages_serve_other_classes_and_return_on_collect() {
    let parent = CountingParent::default();
    let pool = PoolSchema::new(&parent);
    let small = layout(8, 8);
    // Two pages' worth of 8-byte blocks, and then some.
    let per_page = (4096 - pool.config().header_size()) / 8;
    let blocks: Vec<_> = (0..per_page * 2 + 1)
        .map(|_| pool.allocate(small).unwrap())
        .collect();
    assert_eq!(pool.stats().pages, 3);
    // Freeing the first page's blocks empties it; it leaves the class (the class has
    // other partial pages) and becomes a free page.
    let first_page = page_of(blocks[0].ptr.as_ptr(), 4096);
    for a in &blocks {
        if page_of(a.ptr.as_ptr(), 4096) == first_page {
            // SAFETY: allocated above with `small`, freed once.
            unsafe { pool.deallocate(a.ptr, small) };
        }
    }
    assert_eq!(pool.stats().free_pages, 1);
    pool.validate().unwrap();
    // A 512-byte block reuses that page instead of asking the parent.
    let big = layout(512, 8);
    let b = pool.allocate(big).unwrap();
    assert_eq!(page_of(b.ptr.as_ptr(), 4096), first_page);
    assert_eq!(parent.calls.load(Ordering::Relaxed), 3);
    assert_eq!(pool.stats().free_pages, 0);
    // SAFETY: allocated above.
    unsafe { pool.deallocate(b.ptr, big) };
    for a in &blocks {
        if page_of(a.ptr.as_ptr(), 4096) != first_page {
            // SAFETY: allocated above, not freed yet.
            unsafe { pool.deallocate(a.ptr, small) };
        }
    }
    pool.validate().unwrap();
    // Each class keeps its last page until a collection.
    assert!(parent.live.load(Ordering::Relaxed) >= 1);
    pool.garbage_collect();
    let st = pool.stats();
    assert_eq!((st.pages, st.reserved_bytes, st.free_pages), (0, 0, 0));
    assert_eq!(parent.live.load(Ordering::Relaxed), 0);
    pool.validate().unwrap();
    // The pool still works after a collection.
    let c = pool.allocate(small).unwrap();
    // SAFETY: allocated above.
    unsafe { pool.deallocate(c.ptr, small) };
}

#[test]
fn miri_drop_returns_every_page_even_with_live_blocks() {
    let parent = CountingParent::default();
    {
        let config = PoolConfig::new(1024, 64, 256).unwrap();
        let pool = PoolSchema::with_config(&parent, config.with_name("dropped-live"));
        for size in [1, 64, 65, 200, 256] {
            let _leaked = pool.allocate(layout(size, 8)).unwrap();
        }
        assert!(parent.live.load(Ordering::Relaxed) >= 3);
        crate::messages::capture::start();
    }
    assert_eq!(parent.live.load(Ordering::Relaxed), 0);
    // The pool says so in debug builds only (see `Drop for PoolSchema`).
    #[cfg(all(not(miri), debug_assertions))]
    assert!(crate::messages::capture::captured(
        "tagalloc: pool 'dropped-live' dropped with 5 live blocks (768 bytes)"
    ));
}

#[test]
fn miri_custom_geometry_as_in_o3de_tests() {
    let config = PoolConfig::new(1024, 64, 256).unwrap();
    let pool = PoolSchema::with_config(System, config.with_name("o3de-geometry"));
    // Less than the minimum rounds up to it.
    let a = pool.allocate(layout(1, 1)).unwrap();
    assert_eq!(a.size, 64);
    // More than the maximum fails, with a note.
    crate::messages::capture::start();
    assert!(pool.allocate(layout(257, 1)).is_none());
    #[cfg(not(miri))]
    assert!(crate::messages::capture::captured(
        "pool 'o3de-geometry': request of 257 bytes aligned to 1 refused"
    ));
    let n = if cfg!(miri) { 30 } else { 300 };
    let blocks: Vec<_> = (0..n)
        .map(|i| {
            let l = layout(1 + i % 256, 8);
            let b = pool.allocate(l).unwrap();
            fill(b, l.size(), i as u8);
            (b, l, i as u8)
        })
        .collect();
    for (b, l, seed) in blocks {
        check(b, l.size(), seed);
        // SAFETY: allocated above with `l`.
        unsafe { pool.deallocate(b.ptr, l) };
    }
    // SAFETY: allocated above.
    unsafe { pool.deallocate(a.ptr, layout(1, 1)) };
    pool.validate().unwrap();
    assert_eq!(pool.stats().live_blocks, 0);
}

#[test]
fn miri_free_accepts_any_size_between_requested_and_granted() {
    let pool = PoolSchema::new(System);
    let a = pool.allocate(layout(17, 8)).unwrap();
    assert_eq!(a.size, 24);
    // SAFETY: `Allocator::deallocate` may pass the granted size; same class.
    unsafe { pool.deallocate(a.ptr, layout(24, 8)) };
    let st = pool.stats();
    assert_eq!((st.live_blocks, st.granted_bytes), (0, 0));
    // Requested bytes move by what free passes (documented), here 17 - 24.
    assert_eq!(st.requested_bytes, 17usize.wrapping_sub(24));
}

/// A block pointer handed to another thread in a test.
struct SendPtr(NonNull<u8>);
// SAFETY: the tests hand each block to exactly one other thread.
unsafe impl Send for SendPtr {}

#[test]
fn miri_pool_can_move_between_threads() {
    let pool = PoolSchema::new(System);
    let a = SendPtr(pool.allocate(layout(32, 8)).unwrap().ptr);
    let pool = std::thread::spawn(move || {
        let a = a;
        // SAFETY: allocated above with this layout; the pool moved here with its pages.
        unsafe { pool.deallocate(a.0, layout(32, 8)) };
        pool
    })
    .join()
    .unwrap();
    assert_eq!(pool.stats().live_blocks, 0);
}

/// The class lookup (a shift for ordinary alignments, rounding for larger ones) agrees with
/// its definition, "the smallest class at least the size and a multiple of the alignment",
/// for every size and alignment around the edges of several geometries.
#[test]
fn miri_class_of_matches_its_definition() {
    // Under Miri, the small geometry only (the whole sweep takes minutes there).
    let geometries = [
        PoolConfig::new(1024, 64, 256).unwrap(),
        PoolConfig::DEFAULT,
        PoolConfig::new(65536, 16, 1024).unwrap(),
    ];
    for cfg in &geometries[..if cfg!(miri) { 1 } else { 3 }] {
        for align in [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048] {
            for size in 0..=cfg.max_size() + 2 * align {
                let Ok(l) = Layout::from_size_align(size, align) else {
                    continue;
                };
                let expected = (1..=cfg.class_count()).find(|&k| {
                    let block = k * cfg.min_size();
                    block >= size && block % align == 0
                });
                assert_eq!(
                    cfg.class_of(l),
                    expected.map(|k| k - 1),
                    "size {size} align {align} in {cfg:?}"
                );
            }
        }
    }
}

/// Freed blocks wait in their class's bin: the next allocation gets the last one freed, a
/// bin past its limit gives its older half back to the pages, and blocks still in a bin do
/// not make the pool grow: before asking the parent, the pool takes them back to their
/// pages, and a page they emptied serves another class.
#[test]
fn miri_bins_reuse_trim_and_give_way_to_other_classes() {
    let parent = CountingParent::default();
    let pool = PoolSchema::new(&parent);
    let small = layout(8, 8);
    let per_page = (4096 - pool.config().header_size()) / 8;
    let blocks: Vec<_> = (0..per_page + 1)
        .map(|_| pool.allocate(small).unwrap())
        .collect();
    assert_eq!(parent.calls.load(Ordering::Relaxed), 2);
    // LIFO reuse.
    let last = blocks[per_page - 1];
    // SAFETY: allocated above with `small`, freed once (and taken again below).
    unsafe { pool.deallocate(last.ptr, small) };
    let again = pool.allocate(small).unwrap();
    assert_eq!(again.ptr, last.ptr);
    // Freeing the whole first page overfills the bin (limit 64 for 8-byte blocks in 4 KiB
    // pages), so it trims as it goes; the pages and counters stay consistent throughout.
    let first_page = page_of(blocks[0].ptr.as_ptr(), 4096);
    for a in &blocks {
        if page_of(a.ptr.as_ptr(), 4096) == first_page {
            // SAFETY: live, freed once.
            unsafe { pool.deallocate(a.ptr, small) };
            pool.validate().unwrap();
        }
    }
    // Some blocks of the first page still wait in the bin, so it is not empty yet; a
    // 512-byte request finds no page of its class and no empty page, so the pool gives the
    // cached blocks back, which empties the first page, and serves the request from it.
    let big = layout(512, 8);
    let b = pool.allocate(big).unwrap();
    assert_eq!(page_of(b.ptr.as_ptr(), 4096), first_page);
    assert_eq!(parent.calls.load(Ordering::Relaxed), 2);
    pool.validate().unwrap();
    // SAFETY: allocated above; the block of the second page too.
    unsafe {
        pool.deallocate(b.ptr, big);
        pool.deallocate(blocks[per_page].ptr, small);
    }
    pool.validate().unwrap();
    assert_eq!(pool.stats().live_blocks, 0);
    pool.garbage_collect();
    assert_eq!(pool.stats().pages, 0);
    assert_eq!(parent.live.load(Ordering::Relaxed), 0);
}
