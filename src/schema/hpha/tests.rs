//! Unit tests of the HPHA heap on plain memory, so they also run under Miri.

use super::*;
use crate::os::heap_source::HeapPages;
use std::collections::BTreeMap;

fn heap() -> HphaSchema<HeapPages> {
    HphaSchema::new(HeapPages::default())
}

fn layout(size: usize, align: usize) -> Layout {
    Layout::from_size_align(size, align).unwrap()
}

fn fill(a: Allocation, len: usize, seed: u8) {
    // SAFETY: `a` is a live block of at least `len` bytes.
    unsafe {
        for i in 0..len {
            a.ptr.as_ptr().add(i).write(seed.wrapping_add(i as u8));
        }
    }
}

fn check(a: Allocation, len: usize, seed: u8) {
    // SAFETY: `a` is a live block of at least `len` bytes.
    unsafe {
        for i in 0..len {
            assert_eq!(
                *a.ptr.as_ptr().add(i),
                seed.wrapping_add(i as u8),
                "byte {i}"
            );
        }
    }
}

#[test]
fn small_and_large_round_trip_and_counters_return_to_zero() {
    let h = heap();
    let sizes = [0, 1, 8, 24, 100, 512, 513, 4096, 4097, 70_000, 300_000];
    let mut live = Vec::new();
    for (i, &s) in sizes.iter().enumerate() {
        let l = layout(s, 8);
        let a = h.allocate(l).unwrap();
        assert!(a.size >= s.max(1));
        fill(a, s, i as u8);
        live.push((a, l, i as u8));
    }
    let st = h.stats();
    assert_eq!(st.live_blocks, sizes.len());
    assert_eq!(
        st.granted_bytes,
        live.iter().map(|(a, _, _)| a.size).sum::<usize>()
    );
    h.validate().unwrap();
    for (a, l, seed) in live {
        check(a, l.size(), seed);
        // SAFETY: allocated above with `l`.
        unsafe { h.deallocate(a.ptr, l) };
    }
    let st = h.stats();
    assert_eq!((st.live_blocks, st.granted_bytes), (0, 0));
    assert_eq!(st.allocations, st.frees);
    h.validate().unwrap();
}

#[test]
fn alignments_are_honoured_small_large_and_direct() {
    let h = heap();
    let mut live = Vec::new();
    for align_log in 0..=17 {
        let align = 1usize << align_log;
        for size in [1, 40, 600, 5000] {
            let l = layout(size, align);
            let a = h.allocate(l).unwrap();
            assert_eq!(
                a.ptr.as_ptr().addr() % align,
                0,
                "size {size} align {align}"
            );
            fill(a, size, align_log);
            live.push((a, l, align_log));
        }
    }
    h.validate().unwrap();
    for (a, l, seed) in live {
        check(a, l.size(), seed);
        // SAFETY: allocated above with `l`.
        unsafe { h.deallocate(a.ptr, l) };
    }
    h.validate().unwrap();
    assert_eq!(h.stats().live_blocks, 0);
}

#[test]
fn freeing_neighbours_coalesces_and_empty_chunks_go_back() {
    let h = heap();
    let l = layout(10_000, 16);
    let blocks: Vec<_> = (0..6).map(|_| h.allocate(l).unwrap()).collect();
    // SAFETY: (all frees below) each block was allocated with `l` and is freed once.
    unsafe {
        h.deallocate(blocks[1].ptr, l);
        h.validate().unwrap();
        h.deallocate(blocks[3].ptr, l);
        h.validate().unwrap();
        h.deallocate(blocks[2].ptr, l); // joins 1, 2 and 3
        h.validate().unwrap();
        let st = h.stats();
        // One run of 1..=3 plus the chunk's tail.
        assert_eq!(st.free_large_blocks, 2);
        for i in [0, 4, 5] {
            h.deallocate(blocks[i].ptr, l);
            h.validate().unwrap();
        }
    }
    let st = h.stats();
    assert_eq!(st.free_large_blocks, 1, "the whole chunk is one free block");
    assert_eq!(st.chunks, 1, "one empty chunk is kept for reuse");
    h.garbage_collect();
    assert_eq!(h.stats().chunks, 0);
    assert_eq!(h.source().mapped_bytes(), 0, "nothing left mapped");
}

#[test]
fn realloc_shrinks_in_place_grows_into_free_neighbours_and_moves_otherwise() {
    let h = heap();
    let l = layout(20_000, 16);
    let a = h.allocate(l).unwrap();
    let b = h.allocate(l).unwrap();
    fill(a, 20_000, 3);
    // SAFETY: the blocks are live with layout `l`; each is used with its current layout.
    unsafe {
        let shrunk = h.reallocate(a.ptr, l, 8_000).unwrap();
        assert_eq!(shrunk.ptr, a.ptr);
        check(shrunk, 8_000, 3);
        h.validate().unwrap();
        let grown = h.reallocate(a.ptr, layout(8_000, 16), 20_000).unwrap();
        assert_eq!(grown.ptr, a.ptr, "grew back into the space it gave up");
        check(grown, 8_000, 3);
        // `b` follows `a`, so growing further must move.
        let moved = h.reallocate(a.ptr, layout(20_000, 16), 100_000).unwrap();
        assert_ne!(moved.ptr, a.ptr);
        check(moved, 8_000, 3);
        h.validate().unwrap();
        // Free `b`; the moved block can now not grow into it (it is elsewhere), but a block
        // before a free neighbour can.
        h.deallocate(b.ptr, l);
        let small = h.reallocate(moved.ptr, layout(100_000, 16), 16).unwrap();
        check(small, 16, 3);
        assert!(small.size < 4096, "moved down to a small class");
        let same = h.reallocate(small.ptr, layout(16, 16), 12).unwrap();
        assert_eq!(same.ptr, small.ptr, "same class stays in place");
        h.deallocate(same.ptr, layout(12, 16));
    }
    h.validate().unwrap();
    assert_eq!(h.stats().live_blocks, 0);
}

#[test]
fn zeroed_allocations_read_zero_even_after_reuse() {
    let h = heap();
    for size in [8, 300, 4096, 5000, 100_000] {
        let l = layout(size, 8);
        let a = h.allocate(l).unwrap();
        // SAFETY: dirty the block, then free it so the next allocation may reuse it.
        unsafe {
            a.ptr.as_ptr().write_bytes(0xAB, a.size);
            h.deallocate(a.ptr, l);
        }
        let z = h.allocate_zeroed(l).unwrap();
        // SAFETY: `z` is a live block of `z.size` bytes.
        let bytes = unsafe { core::slice::from_raw_parts(z.ptr.as_ptr(), z.size) };
        assert!(bytes.iter().all(|&b| b == 0), "size {size}");
        // SAFETY: allocated above with `l`.
        unsafe { h.deallocate(z.ptr, l) };
    }
}

#[test]
fn garbage_collect_returns_small_pages_and_segments() {
    let h = heap();
    let l = layout(64, 8);
    let n = if cfg!(miri) { 3000 } else { 40_000 };
    let blocks: Vec<_> = (0..n).map(|_| h.allocate(l).unwrap()).collect();
    let before = h.stats();
    assert!(before.small_pages >= n * 64 / SMALL_PAGE_SIZE);
    for b in blocks {
        // SAFETY: allocated above with `l`.
        unsafe { h.deallocate(b.ptr, l) };
    }
    assert_eq!(h.stats().small_pages, 1, "the class keeps one empty page");
    h.garbage_collect();
    let after = h.stats();
    assert_eq!((after.small_pages, after.segments), (0, 0));
    assert_eq!(h.source().mapped_bytes(), 0);
}

#[test]
fn large_requests_and_huge_alignment_get_their_own_mapping() {
    let h = heap();
    let l = layout(100, 1 << 20);
    let a = h.allocate(l).unwrap();
    assert_eq!(a.ptr.as_ptr().addr() % (1 << 20), 0);
    assert_eq!(h.stats().direct_blocks, 1);
    fill(a, 100, 9);
    // SAFETY: allocated above with `l`; then resized with its current layout.
    unsafe {
        let grown = h.reallocate(a.ptr, l, 200_000).unwrap();
        check(grown, 100, 9);
        assert_eq!(grown.ptr.as_ptr().addr() % (1 << 20), 0);
        h.deallocate(grown.ptr, layout(200_000, 1 << 20));
    }
    assert_eq!(h.stats().direct_blocks, 0);
    // The freed mapping is kept for reuse until the purge delay passes or a collection.
    h.garbage_collect();
    assert_eq!(h.source().mapped_bytes(), 0);
}

#[test]
#[cfg_attr(
    miri,
    ignore = "Miri aborts on a huge host allocation instead of failing it"
)]
fn impossible_requests_return_none() {
    let h = heap();
    let huge = Layout::from_size_align(isize::MAX as usize - 4095, 4096).unwrap();
    assert!(h.allocate(huge).is_none());
    let huge = Layout::from_size_align(isize::MAX as usize / 2, 1).unwrap();
    assert!(h.allocate(huge).is_none());
    assert_eq!(h.stats().live_blocks, 0);
}

/// A tiny deterministic generator for the randomised tests of this module and `tree`.
pub(super) struct XorShift(pub(super) u64);
impl XorShift {
    pub(super) fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

#[test]
fn random_operations_match_a_shadow_model() {
    let h = heap();
    let ops = if cfg!(miri) { 300 } else { 20_000 };
    let mut rng = XorShift(0xdead_beef_1234_5678);
    // address -> (allocation, layout, seed)
    let mut live: BTreeMap<usize, (Allocation, Layout, u8)> = BTreeMap::new();
    for op in 0..ops {
        let r = rng.next();
        if live.is_empty() || r % 3 != 0 {
            let size = match r % 10 {
                0..=5 => (rng.next() % 600) as usize,
                6..=8 => (rng.next() % 40_000) as usize,
                _ => (rng.next() % 400_000) as usize,
            };
            let align = 1usize << (rng.next() % 13);
            let l = layout(size, align);
            let a = h.allocate(l).unwrap();
            assert_eq!(a.ptr.as_ptr().addr() % align, 0);
            let seed = op as u8;
            fill(a, size.min(64), seed);
            let start = a.ptr.as_ptr().addr();
            if let Some((&prev, (pa, _, _))) = live.range(..start).next_back() {
                assert!(prev + pa.size <= start, "overlaps the block before");
            }
            if let Some((&next, _)) = live.range(start..).next() {
                assert!(start + a.size <= next, "overlaps the block after");
            }
            live.insert(start, (a, l, seed));
        } else {
            let idx = (rng.next() % live.len() as u64) as usize;
            let key = *live.keys().nth(idx).unwrap();
            let (a, l, seed) = live.remove(&key).unwrap();
            check(a, l.size().min(64), seed);
            if r % 2 == 0 {
                let new_size = (rng.next() % 50_000) as usize;
                // SAFETY: `a` is live with layout `l`.
                let b = unsafe { h.reallocate(a.ptr, l, new_size) }.unwrap();
                check(b, l.size().min(64).min(new_size), seed);
                let nl = layout(new_size, l.align());
                fill(b, new_size.min(64), seed);
                live.insert(b.ptr.as_ptr().addr(), (b, nl, seed));
            } else {
                // SAFETY: `a` is live with layout `l`.
                unsafe { h.deallocate(a.ptr, l) };
            }
        }
        if op % 97 == 0 || cfg!(miri) && op % 10 == 0 {
            h.validate().unwrap();
            let st = h.stats();
            assert_eq!(st.live_blocks, live.len());
            assert_eq!(
                st.granted_bytes,
                live.values().map(|(a, _, _)| a.size).sum::<usize>()
            );
        }
    }
    for (_, (a, l, seed)) in std::mem::take(&mut live) {
        check(a, l.size().min(64), seed);
        // SAFETY: live with layout `l`.
        unsafe { h.deallocate(a.ptr, l) };
    }
    h.validate().unwrap();
    h.garbage_collect();
    assert_eq!(h.source().mapped_bytes(), 0);
}

#[test]
#[cfg_attr(
    miri,
    ignore = "7 minutes under Miri (a segment per tag); runs natively in cargo test"
)]
fn miri_tagged_blocks_keep_their_tag_through_reallocation_and_free_into_their_heap() {
    let h = heap();
    let tags: [Tag; 4] = [0, 1, 300, (MAX_TAGS - 1) as Tag];
    // Under Miri every byte filled and checked is interpreted: large blocks stay large there
    // (past the small classes) but smaller.
    let big = if cfg!(miri) { 40_000 } else { 200_000 };
    let sizes = [8, 100, 4096, 5000, big];
    let mut live = Vec::new();
    for &tag in &tags {
        for (i, &size) in sizes.iter().enumerate() {
            let l = layout(size, 16);
            let a = h.allocate_tagged(l, tag).unwrap();
            fill(a, size, i as u8);
            // SAFETY: `a` was just allocated with `l`.
            assert_eq!(unsafe { h.tag_of(a.ptr, l) }, tag, "size {size}");
            live.push((a, l, tag, i as u8));
        }
    }
    // Small blocks of different tags never share a segment.
    for (a, l, tag, _) in &live {
        for (b, m, other, _) in &live {
            if tag != other && l.size() <= MAX_SMALL && m.size() <= MAX_SMALL {
                let seg = |p: NonNull<u8>| p.as_ptr() as usize / SEGMENT_SIZE;
                assert_ne!(seg(a.ptr), seg(b.ptr), "tags {tag} and {other}");
            }
        }
    }
    h.validate().unwrap();
    // Reallocations across the small/large line and within each keep the tag.
    for (a, l, tag, seed) in &mut live {
        for new_size in [24, 6000, 64, big + big / 2] {
            let keep = l.size().min(new_size);
            // SAFETY: `a` is live with `l`; on success it moves to `new_size`.
            let b = unsafe { h.reallocate(a.ptr, *l, new_size) }.unwrap();
            let m = layout(new_size, 16);
            check(b, keep, *seed);
            fill(b, new_size, *seed);
            // SAFETY: `b` is live with `m`.
            assert_eq!(unsafe { h.tag_of(b.ptr, m) }, *tag);
            (*a, *l) = (b, m);
        }
    }
    for (a, l, _, seed) in live {
        check(a, l.size(), seed);
        // SAFETY: live with `l`.
        unsafe { h.deallocate(a.ptr, l) };
    }
    let st = h.stats();
    assert_eq!((st.live_blocks, st.granted_bytes), (0, 0));
    h.validate().unwrap();
    // Beyond the last tag: refused, not wrapped.
    assert!(h.allocate_tagged(layout(8, 8), MAX_TAGS as Tag).is_none());
    assert!(
        h.allocate_tagged(layout(9000, 8), MAX_TAGS as Tag)
            .is_none()
    );
}

/// A freed block with its own mapping keeps the mapping (counted as held) for the next
/// block of about its size, which gets it back with its pages; a reallocation growing a
/// direct block takes a kept mapping of the new size with its contents copied; and
/// `garbage_collect` lets every kept mapping go.
#[test]
fn freed_direct_mappings_are_kept_reused_and_collected() {
    let h = heap();
    let big = layout(large::DIRECT_THRESHOLD + 4096, 16);
    let held_before = h.stats().held_bytes;
    let a = h.allocate(big).unwrap();
    fill(a, 4096, 1);
    let held_live = h.stats().held_bytes;
    assert!(held_live >= held_before + big.size());
    // SAFETY: live with layout `big`.
    unsafe { h.deallocate(a.ptr, big) };
    let st = h.stats();
    assert_eq!((st.live_blocks, st.direct_blocks), (0, 0));
    assert_eq!(st.held_bytes, held_live, "the mapping is kept");
    let b = h.allocate(big).unwrap();
    assert_eq!(b.ptr, a.ptr, "the kept mapping comes back");
    assert_eq!(h.stats().held_bytes, held_live);
    // A block twice the size does not fit the kept one; when freed, it is kept too.
    let twice = layout(2 * big.size(), 16);
    let c = h.allocate(twice).unwrap();
    // SAFETY: live with layout `twice`.
    unsafe { h.deallocate(c.ptr, twice) };
    // Growing `b` to that size takes the kept mapping, contents and all (under Miri a
    // prefix: it interprets every byte, and megabytes take it minutes).
    let filled = if cfg!(miri) { 4096 } else { big.size() };
    fill(b, filled, 7);
    // SAFETY: `b` is live with layout `big`.
    let grown = unsafe { h.reallocate(b.ptr, big, twice.size()) }.unwrap();
    assert_eq!(grown.ptr, c.ptr, "the kept mapping of the new size");
    check(grown, filled, 7);
    let st = h.stats();
    assert_eq!((st.live_blocks, st.direct_blocks), (1, 1));
    assert_eq!(st.allocations, st.frees + 1);
    h.validate().unwrap();
    // SAFETY: live with the grown size.
    unsafe { h.deallocate(grown.ptr, twice) };
    h.garbage_collect();
    let st = h.stats();
    assert_eq!((st.live_blocks, st.granted_bytes), (0, 0));
    assert_eq!(
        st.held_bytes, held_before,
        "garbage_collect unmaps the kept mappings"
    );
}
