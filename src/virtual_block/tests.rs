//! Tests of the virtual block: regressions from peers' bugs, VMA's and OffsetAllocator's
//! checks, and property tests against a shadow interval map. All of them run under Miri
//! (with fewer proptest cases there).

use std::collections::BTreeMap;

use proptest::prelude::{
    Just, ProptestConfig, any, prop_assert, prop_assert_eq, prop_oneof, proptest,
};
use proptest::strategy::Strategy as _;

use super::*;

/// A tiny deterministic generator (xorshift64*) so fixed-seed tests need no dependency.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

fn req(size: u64) -> Request<'static> {
    Request::new(size)
}

/// Whether any free range of `b` can hold `size` aligned to `align` (the definition of "a
/// false out-of-memory is impossible").
fn fits_somewhere<U>(b: &VirtualBlock<U>, size: u64, align: u64) -> bool {
    b.free_ranges().any(|(o, s)| {
        let at = o.next_multiple_of(align);
        at.checked_add(size).is_some_and(|e| e <= o + s)
    })
}

/// VMA's checks: ranges sorted without overlap, alignment, statistics equal recomputed sums.
fn check_consistent<U>(b: &VirtualBlock<U>) {
    b.validate().unwrap();
    let mut end = 0;
    let (mut count, mut bytes, mut free_count, mut free_max, mut alloc_min) =
        (0u32, 0, 0u32, 0, u64::MAX);
    for r in b.ranges() {
        assert_eq!(r.offset(), end, "ranges must tile the block");
        end += r.size();
        match r {
            Range::Allocation(a) => {
                assert_eq!(a.offset % a.align, 0);
                count += 1;
                bytes += a.size;
                alloc_min = alloc_min.min(a.size);
            }
            Range::Reserved { size, .. } => {
                count += 1;
                bytes += size;
                alloc_min = alloc_min.min(size);
            }
            Range::Free { size, .. } => {
                free_count += 1;
                free_max = free_max.max(size);
            }
        }
    }
    assert_eq!(end, b.capacity());
    let s = b.statistics();
    assert_eq!(
        (s.allocation_count, s.allocation_bytes, s.block_bytes),
        (count, bytes, b.capacity())
    );
    let d = b.detailed_statistics();
    assert_eq!(d.statistics, s);
    assert_eq!(d.unused_range_count, free_count);
    assert_eq!(d.unused_range_size_max, free_max);
    assert_eq!(d.allocation_size_min, alloc_min);
    assert_eq!(b.largest_free(), free_max);
    assert_eq!(b.free_bytes(), b.capacity() - bytes);
}

// ---- False out-of-memory regressions (research §2: OffsetAllocator PR #11, PR #14, issue #3;
// ---- O3DE's exact-size free-list lookup).

#[test]
fn no_false_oom_offset_allocator_pr11() {
    // offset-allocator 0.2: new(324), allocate(255), allocate(67) fails with 69 units free.
    let mut b = VirtualBlock::<()>::new(324);
    b.allocate(&req(255), ()).unwrap();
    let a = b.allocate(&req(67), ()).unwrap();
    assert_eq!(a.offset(), 255);
    check_consistent(&b);
}

#[test]
fn no_false_oom_offset_allocator_pr14() {
    // offset-allocator 0.2: an empty block of 699050 refuses 664908.
    let mut b = VirtualBlock::<()>::new(699_050);
    let a = b.allocate(&req(664_908), ()).unwrap();
    assert_eq!(a.offset(), 0);
    // And the whole block in one piece, at every strategy.
    for s in [
        Strategy::Balanced,
        Strategy::MinTime,
        Strategy::MinMemory,
        Strategy::MinOffset,
    ] {
        let mut b = VirtualBlock::<()>::new(699_050);
        b.allocate(&req(699_050).strategy(s), ()).unwrap();
    }
}

#[test]
fn no_false_oom_offset_allocator_issue3() {
    // offset-allocator 0.2: with_max_allocs(1 << 20, 2), the first allocate(32) fails. There
    // is no allocation cap here: both succeed, and so do many more.
    let mut b = VirtualBlock::<()>::new(1 << 20);
    for i in 0..(if cfg!(miri) { 64 } else { 4096 }) {
        assert_eq!(b.allocate(&req(32), ()).unwrap().offset(), 32 * i);
    }
    check_consistent(&b);
}

#[test]
fn no_false_oom_o3de_small_allocation_from_fresh_block() {
    // O3DE's BestFitExternalMapSchema looks the free list up by exact size: a small request
    // from a fresh 4 MiB block finds no chunk of exactly that size.
    let mut b = VirtualBlock::<()>::new(4 << 20);
    let a = b.allocate(&req(16).align(16), ()).unwrap();
    let c = b.allocate(&req(1000).align(16), ()).unwrap();
    b.free(a).unwrap();
    // Reuse by a different size (O3DE needed an exact match, and merged only on GC).
    let d = b
        .allocate(&req(8).align(16).strategy(Strategy::MinMemory), ())
        .unwrap();
    assert_eq!(d.offset(), 0);
    b.free(c).unwrap();
    b.free(d).unwrap();
    assert_eq!(b.largest_free(), 4 << 20, "freed ranges merge at once");
    assert_eq!(b.allocate(&req(4 << 20), ()).unwrap().offset(), 0);
}

#[test]
fn no_false_oom_alignment_inside_a_class() {
    // A free range that only fits with its real offset, not with worst-case padding: the good
    // fit finds nothing and the exact search must.
    let mut b = VirtualBlock::<()>::new(4096);
    let a = b.allocate(&req(256), ()).unwrap();
    let _keep = b.allocate(&req(300), ()).unwrap();
    b.free(a).unwrap();
    // Free: [0, 256) and [556, 4096). Fill the tail.
    b.allocate(&req(4096 - 556), ()).unwrap();
    // [0, 256) at alignment 256 holds 256 units exactly; worst-case padding would say no.
    for s in [
        Strategy::Balanced,
        Strategy::MinTime,
        Strategy::MinMemory,
        Strategy::MinOffset,
    ] {
        let x = b.allocate(&req(256).align(256).strategy(s), ()).unwrap();
        assert_eq!(x.offset(), 0);
        b.free(x).unwrap();
    }
    assert!(matches!(
        b.allocate(&req(257), ()),
        Err(Error::OutOfSpace {
            size: 257,
            largest_free_at_least: 256,
            free_bytes: 256,
            ..
        })
    ));
}

#[test]
fn no_false_oom_when_the_best_fit_walk_runs_out() {
    // One free range of 100 that fits at alignment 128, listed behind more than the walk
    // budget of same-sized ranges that do not (they start 1 past an aligned offset).
    let n = tlsf::BEST_FIT_BUDGET as u64 + 8;
    let mut b = VirtualBlock::<()>::new(128 * (n + 1));
    let mut holes = Vec::new();
    let good = b.allocate(&req(100), ()).unwrap(); // [0, 100): aligned
    b.allocate(&req(28), ()).unwrap();
    for _ in 0..n {
        b.allocate(&req(1), ()).unwrap();
        holes.push(b.allocate(&req(100), ()).unwrap()); // starts at 128k + 1
        b.allocate(&req(27), ()).unwrap();
    }
    assert_eq!(b.free_bytes(), 0);
    b.free(good).unwrap(); // freed first: the last in its list's walk order
    for h in holes {
        b.free(h).unwrap();
    }
    for s in [
        Strategy::MinMemory,
        Strategy::Balanced,
        Strategy::MinTime,
        Strategy::MinOffset,
    ] {
        let a = b.allocate(&req(100).align(128).strategy(s), ()).unwrap();
        assert_eq!(a.offset(), 0, "{s:?}");
        b.free(a).unwrap();
    }
    check_consistent(&b);
}

// ---- Failures in bounded time.

/// The free ranges the TLSF searches of `b` have looked at so far.
fn examined<U>(b: &VirtualBlock<U>) -> u64 {
    match &b.engine {
        Engine::Tlsf(t) => t.examined,
        Engine::Linear(_) => 0,
    }
}

/// `groups` holes of 509 units, each 2 units past a multiple of 512, between allocations:
/// 256 units aligned to 256 fit in none of them. Returns the block and the allocations after
/// each hole.
fn misaligned_holes(groups: u64) -> (VirtualBlock<()>, Vec<Alloc>) {
    let mut b = VirtualBlock::<()>::new(groups * 512);
    let mut holes = Vec::new();
    let mut after = Vec::new();
    for _ in 0..groups {
        b.allocate(&req(2), ()).unwrap();
        holes.push(b.allocate(&req(509), ()).unwrap());
        after.push(b.allocate(&req(1), ()).unwrap());
    }
    for h in holes {
        b.free(h).unwrap();
    }
    (b, after)
}

#[test]
fn a_failure_walks_the_holes_once_then_skips_them() {
    let groups = if cfg!(miri) { 20 } else { 2000 };
    for s in [
        Strategy::Balanced,
        Strategy::MinTime,
        Strategy::MinMemory,
        Strategy::MinOffset,
    ] {
        let (mut b, after) = misaligned_holes(groups);
        let r = req(256).align(256).strategy(s);
        assert!(matches!(
            b.allocate(&r, ()),
            Err(Error::OutOfSpace { largest_free_at_least, .. }) if largest_free_at_least <= 509
        ));
        let first = examined(&b);
        assert!(
            first >= groups,
            "{s:?}: the first failure proves it range by range"
        );
        // The same failure again, and a harder one (larger, or more aligned): no range looked at.
        for r in [r, req(300).align(256), req(256).align(4096)] {
            assert!(b.allocate(&r.strategy(s), ()).is_err());
        }
        assert_eq!(
            examined(&b),
            first,
            "{s:?}: later failures skip the summarised lists"
        );
        // Small allocations come and go (carved from a hole, merged back) without undoing
        // that. (MinOffset walks every range to place them: its documented cost.)
        let small = b.allocate(&req(3).strategy(s), ()).unwrap();
        b.free(small).unwrap();
        let before = examined(&b);
        assert!(b.allocate(&r, ()).is_err());
        assert_eq!(examined(&b), before, "{s:?}");
        // A hole grows by merging with the allocation after it: now [2, 512) at 256 holds 256.
        // The summary must let the search see it (no false out-of-memory).
        let k = after.len() / 2;
        b.free(after[k]).unwrap();
        let a = b.allocate(&r, ()).unwrap();
        assert_eq!(a.offset(), k as u64 * 512 + 256, "{s:?}");
        b.validate().unwrap();
        // Its list's bound is loose now: the next failure walks that list once, then not.
        let before = examined(&b);
        assert!(b.allocate(&r, ()).is_err());
        let walked = examined(&b);
        assert!(walked > before, "{s:?}: the loose list is walked again");
        assert!(b.allocate(&r, ()).is_err());
        assert_eq!(examined(&b), walked, "{s:?}");
        b.validate().unwrap();
    }
}

#[test]
fn a_smaller_alignment_is_searched_again() {
    // A summary for alignment 256 says nothing about alignment 2: the search walks, and
    // finds the range that fits there.
    let (mut b, _) = misaligned_holes(if cfg!(miri) { 8 } else { 200 });
    assert!(b.allocate(&req(256).align(256), ()).is_err());
    let a = b.allocate(&req(507).align(4), ()).unwrap();
    assert_eq!(a.offset() % 512, 4);
    b.validate().unwrap();
}

#[test]
fn out_of_space_figures_are_cheap_and_true() {
    // TLSF: the largest free range when it is alone in its class, else its class's floor.
    let mut b = VirtualBlock::<()>::new(1000);
    b.allocate(&req(900), ()).unwrap();
    match b.allocate(&req(200), ()) {
        Err(Error::OutOfSpace {
            free_bytes: 100,
            largest_free_at_least: 100,
            ..
        }) => {}
        other => panic!("{other:?}"),
    }
    let (mut b, _) = misaligned_holes(40);
    match b.allocate(&req(600), ()) {
        Err(Error::OutOfSpace {
            largest_free_at_least: l,
            ..
        }) => assert!(l <= 509 && 509 < l + l / 32 + 1, "{l}"),
        other => panic!("{other:?}"),
    }
    // Linear: the space at the ends, not the hole in the middle.
    let mut l = VirtualBlock::<()>::new_linear(1000);
    let a: Vec<_> = (0..10).map(|_| l.allocate(&req(90), ()).unwrap()).collect();
    l.free(a[4]).unwrap(); // a hole of 90 in the middle, 100 free at the top
    let lower_only = |l: &mut VirtualBlock<()>, r: Request<'_>| match l.allocate(&r, ()) {
        Err(Error::OutOfSpace {
            largest_free_at_least,
            free_bytes,
            ..
        }) => (largest_free_at_least, free_bytes),
        other => panic!("{other:?}"),
    };
    assert_eq!(lower_only(&mut l, req(101)), (100, 190));
    // Ring: the oldest are freed, the next allocation wraps to the start.
    l.free(a[0]).unwrap();
    l.free(a[1]).unwrap();
    assert_eq!(lower_only(&mut l, req(181)), (180, 370));
    let w = l.allocate(&req(170), ()).unwrap();
    assert_eq!(w.offset(), 0);
    assert_eq!(lower_only(&mut l, req(11)), (10, 200));
    // Double stack: between the stacks only.
    let mut d = VirtualBlock::<()>::new_linear(1000);
    let low = d.allocate(&req(100), ()).unwrap();
    d.allocate(&req(100), ()).unwrap();
    d.allocate(&req(500).upper_address(), ()).unwrap();
    d.free(low).unwrap();
    assert_eq!(lower_only(&mut d, req(301)), (300, 400));
}

// ---- OffsetAllocator's own unit tests, in our terms.

#[test]
fn offset_allocator_zero_fragmentation() {
    // 256 allocations of 1 Mi, freed in a scrambled order, then 256 Mi must land at 0.
    const MI: u64 = 1 << 20;
    let mut b = VirtualBlock::<()>::new(256 * MI);
    let mut allocs: Vec<Alloc> = (0..256)
        .map(|_| b.allocate(&req(MI), ()).unwrap())
        .collect();
    for (i, a) in allocs.iter().enumerate() {
        assert_eq!(a.offset(), i as u64 * MI);
    }
    assert!(matches!(
        b.allocate(&req(1), ()),
        Err(Error::OutOfSpace { .. })
    ));
    // Free every other one, then the rest.
    let odd: Vec<Alloc> = allocs.iter().copied().skip(1).step_by(2).collect();
    allocs = allocs.into_iter().step_by(2).collect();
    for a in odd.into_iter().chain(allocs) {
        b.free(a).unwrap();
    }
    check_consistent(&b);
    assert_eq!(b.allocate(&req(256 * MI), ()).unwrap().offset(), 0);
}

#[test]
fn offset_allocator_merge_and_reuse() {
    let mut b = VirtualBlock::<()>::new(1 << 20);
    let a = b.allocate(&req(1337), ()).unwrap();
    b.free(a).unwrap();
    let c = b.allocate(&req(1337), ()).unwrap();
    assert_eq!(c.offset(), 0, "merge trivial");
    let d = b.allocate(&req(1024), ()).unwrap();
    b.free(c).unwrap();
    let e = b.allocate(&req(1000), ()).unwrap();
    assert_eq!(
        e.offset(),
        0,
        "reuse: a smaller request takes the freed hole first"
    );
    b.free(d).unwrap();
    b.free(e).unwrap();
    assert!(b.is_empty());
    assert_eq!(b.detailed_statistics().unused_range_count, 1);
}

// ---- VMA's TestVirtualBlocksAlgorithms, in our terms.

#[test]
fn vma_virtual_blocks_algorithms() {
    for algorithm in [Algorithm::Tlsf, Algorithm::Linear] {
        let mut rng = Rng(3_454_335);
        let mut b = VirtualBlock::<u64>::with_algorithm(10_000, algorithm);
        let strategies = [
            Strategy::Balanced,
            Strategy::MinMemory,
            Strategy::MinTime,
            Strategy::MinOffset,
        ];
        let mut allocs: Vec<(Alloc, u64, u64)> = Vec::new(); // handle, size, align
        let allocate = |b: &mut VirtualBlock<u64>, i: usize, rng: &mut Rng| {
            let size = rng.below(20) + 5;
            let align = if i % 3 == 0 { 16 } else { 1 };
            let mut r = req(size).align(align).strategy(strategies[i % 4]);
            if algorithm == Algorithm::Linear && i % 4 == 0 {
                r = r.upper_address();
            }
            let a = b.allocate(&r, size * 10).unwrap();
            (a, size, align)
        };
        for i in 0..30 {
            allocs.push(allocate(&mut b, i, &mut rng));
        }
        // Free 10 at random (linear: any order is allowed, holes stay until the ends move).
        for _ in 0..10 {
            let (a, _, _) = allocs.swap_remove(rng.below(allocs.len() as u64) as usize);
            assert_eq!(b.free(a).unwrap() % 10, 0);
        }
        for i in 30..40 {
            allocs.push(allocate(&mut b, i, &mut rng));
        }
        check_consistent(&b);
        // No overlap after sorting by offset; alignment; user data.
        let mut sorted: Vec<_> = allocs
            .iter()
            .map(|&(a, size, align)| {
                let info = b.info(a).unwrap();
                assert_eq!(
                    (info.size, info.align, *info.user),
                    (size, align, size * 10)
                );
                assert_eq!(info.offset % align, 0);
                (info.offset, size)
            })
            .collect();
        sorted.sort_unstable();
        for w in sorted.windows(2) {
            assert!(w[0].0 + w[0].1 <= w[1].0, "overlap in {algorithm:?}");
        }
        let s = b.statistics();
        assert_eq!(s.allocation_count as usize, allocs.len());
        assert_eq!(s.allocation_bytes, allocs.iter().map(|a| a.1).sum::<u64>());
        // JSON parses and carries the same figures.
        let json: serde_json::Value = serde_json::from_str(&b.to_json_with(true, |u| *u)).unwrap();
        assert_eq!(json["Stats"]["AllocationCount"], s.allocation_count);
        assert_eq!(
            json["Details"]["Suballocations"].as_array().unwrap().len(),
            b.ranges().count()
        );
        b.clear();
        assert!(b.is_empty());
        check_consistent(&b);
        assert_eq!(b.statistics().allocation_bytes, 0);
        assert!(matches!(b.free(allocs[0].0), Err(Error::StaleHandle)));
    }
}

// ---- Sizes near 2^64: aligned Balanced requests above 2^63 take the general core.

#[test]
fn sizes_near_the_top_of_the_range_are_placed_exactly() {
    let mut b = VirtualBlock::<()>::new(u64::MAX);
    let big = b.allocate(&req((1 << 63) + 5).align(16), ()).unwrap();
    assert_eq!(big.offset, 0);
    let half = b.allocate(&req(1 << 62).align(16), ()).unwrap();
    assert_eq!(half.offset, (1 << 63) + 16);
    assert!(matches!(
        b.allocate(&req(1 << 62).align(1 << 62), ()),
        Err(Error::OutOfSpace { .. })
    ));
    assert!(matches!(
        b.allocate(&req(1 << 63).align(16), ()),
        Err(Error::OutOfSpace { .. })
    ));
    b.free(big).unwrap();
    let top = b.allocate(&req(1 << 63).align(1 << 63), ()).unwrap();
    assert_eq!(top.offset, 0);
    b.free(top).unwrap();
    b.free(half).unwrap();
    let all = b.allocate(&req(u64::MAX).align(2), ()).unwrap();
    assert_eq!(all.offset, 0);
    b.validate().unwrap();
}

// ---- Bad input: typed errors, nothing changes.

#[test]
fn bad_input_gives_typed_errors() {
    let mut b = VirtualBlock::<()>::new(1000);
    let mut other = VirtualBlock::<()>::new(1000);
    assert_eq!(b.allocate(&req(0), ()), Err(Error::ZeroSize));
    assert_eq!(b.allocate(&req(0).align(16), ()), Err(Error::ZeroSize));
    assert_eq!(
        b.allocate(&req((1 << 63) + 1).align(3), ()),
        Err(Error::BadAlignment(3))
    );
    assert_eq!(
        b.allocate(&req(8).align(3), ()),
        Err(Error::BadAlignment(3))
    );
    assert_eq!(
        b.allocate(&req(8).upper_address(), ()),
        Err(Error::UpperAddressNotLinear)
    );
    assert!(matches!(
        b.allocate(&req(1001), ()),
        Err(Error::OutOfSpace { .. })
    ));
    assert!(matches!(
        b.allocate(&req(u64::MAX).align(1 << 63), ()),
        Err(Error::OutOfSpace { .. })
    ));
    let a = b.allocate(&req(8), ()).unwrap();
    let foreign = other.allocate(&req(8), ()).unwrap();
    assert_eq!(b.free(foreign), Err(Error::ForeignHandle));
    assert_eq!(other.info(a).map(|i| i.size), Err(Error::ForeignHandle));
    b.free(a).unwrap();
    assert_eq!(b.free(a), Err(Error::StaleHandle), "double free");
    // The slot is reused; the old handle still does not reach the new allocation.
    let c = b.allocate(&req(8), ()).unwrap();
    assert_eq!(b.free(a), Err(Error::StaleHandle));
    assert_eq!(b.set_tag(a, None), Err(Error::StaleHandle));
    assert!(b.contains(c) && !b.contains(a));
    assert_eq!(
        b.grow(10),
        Err(Error::CannotShrink {
            capacity: 1000,
            requested: 10
        })
    );
    check_consistent(&b);
    check_consistent(&other);
    // Every error has a message.
    assert!(Error::DefragPending.to_string().contains("pass"));
}

#[test]
fn emptied_block_reuses_ids_but_old_handles_stay_stale() {
    // Freeing the last allocation restarts the TLSF node arena, so node ids (the handles'
    // identities) are handed out again from the start; the generation must still tell the
    // old handles apart, with the same offsets and the same ids.
    let mut b = VirtualBlock::<u32>::new(1000);
    let old: Vec<Alloc> = (0..4).map(|i| b.allocate(&req(100), i).unwrap()).collect();
    for &a in old.iter().rev() {
        b.free(a).unwrap();
        b.validate().unwrap();
    }
    let new: Vec<Alloc> = (0..4)
        .map(|i| b.allocate(&req(100), 10 + i).unwrap())
        .collect();
    for (o, n) in old.iter().zip(&new) {
        assert_eq!(o.offset(), n.offset());
        assert_eq!(b.free(*o), Err(Error::StaleHandle));
        assert_eq!(b.user_data(*o).err(), Some(Error::StaleHandle));
    }
    assert_eq!(b.len(), 4);
    for (i, n) in new.iter().enumerate() {
        assert_eq!(b.free(*n), Ok(10 + i as u32));
    }
    b.validate().unwrap();
    assert_eq!(b.largest_free(), 1000);
}

#[test]
fn zero_sized_user_data_is_dropped_once_per_allocation() {
    // Zero-sized user data is kept without ids (see `Users`): the values handed back must
    // still balance the values given, whichever way allocations end.
    thread_local!(static DROPS: std::cell::Cell<usize> = const { std::cell::Cell::new(0) });
    struct Token;
    impl Drop for Token {
        fn drop(&mut self) {
            DROPS.with(|d| d.set(d.get() + 1));
        }
    }
    let drops = || DROPS.with(std::cell::Cell::get);
    let mut b = VirtualBlock::<Token>::new(1000);
    let a: Vec<Alloc> = (0..5)
        .map(|_| b.allocate(&req(10), Token).unwrap())
        .collect();
    assert_eq!(drops(), 0);
    drop(b.free(a[1]).unwrap());
    assert_eq!(drops(), 1);
    assert!(b.user_data(a[0]).is_ok() && b.user_data_mut(a[4]).is_ok());
    assert_eq!(b.user_data(a[1]).err(), Some(Error::StaleHandle));
    assert!(b.free(a[1]).is_err());
    assert_eq!(drops(), 1, "a stale free hands nothing back");
    b.clear();
    assert_eq!(drops(), 5);
    b.allocate(&req(10), Token).unwrap();
    b.validate().unwrap();
    drop(b);
    assert_eq!(drops(), 6);
}

#[test]
fn zero_sized_user_data_without_drop_is_not_kept() {
    // `()` and other zero-sized types without drop glue are not kept at all (see `Users`):
    // a live handle still has user data, a stale one none.
    #[derive(Debug, PartialEq)]
    struct Marker;
    let mut b = VirtualBlock::<Marker>::new(1000);
    let a: Vec<Alloc> = (0..5)
        .map(|_| b.allocate(&req(10).align(16), Marker).unwrap())
        .collect();
    assert_eq!(b.free(a[1]), Ok(Marker));
    assert_eq!(b.user_data(a[0]), Ok(&Marker));
    *b.user_data_mut(a[4]).unwrap() = Marker;
    assert_eq!(b.info(a[3]).unwrap().user, &Marker);
    assert_eq!(b.user_data(a[1]).err(), Some(Error::StaleHandle));
    assert_eq!(b.user_data_mut(a[1]).err(), Some(Error::StaleHandle));
    assert!(b.free(a[1]).is_err());
    b.validate().unwrap();
    let mut u = VirtualBlock::<()>::new(100);
    let x = u.allocate(&req(100), ()).unwrap();
    assert_eq!(u.user_data(x), Ok(&()));
    assert_eq!(u.free(x), Ok(()));
    assert_eq!(u.free(x), Err(Error::StaleHandle));
    u.validate().unwrap();
}

#[test]
fn names_tags_and_user_data() {
    let mut b = VirtualBlock::<String>::new(1000);
    let mesh = Tag::new("mesh");
    let a = b
        .allocate(&req(10).tag(mesh).name("cube"), "payload".to_string())
        .unwrap();
    let i = b.info(a).unwrap();
    assert_eq!(
        (i.name, i.tag, i.user.as_str()),
        (Some("cube"), Some(mesh), "payload")
    );
    b.user_data_mut(a).unwrap().push('!');
    b.set_allocation_name(a, Some("sphere")).unwrap();
    b.set_tag(a, Some(Tag::new("other"))).unwrap();
    let i = b.info(a).unwrap();
    assert_eq!(
        (i.name, i.tag.map(Tag::name)),
        (Some("sphere"), Some("other"))
    );
    assert_eq!(b.free(a).unwrap(), "payload!");
}

#[test]
fn alignment_zero_means_one() {
    // As in VMA: TLSF, linear, and the pointer facade.
    let mut b = VirtualBlock::<()>::new(100);
    let x = b.allocate(&req(3), ()).unwrap();
    let a = b.allocate(&req(5).align(0), ()).unwrap();
    assert_eq!((a.offset(), b.info(a).unwrap().align), (3, 1));
    assert!(matches!(
        b.allocate(&req(200).align(0), ()),
        Err(Error::OutOfSpace { align: 1, .. })
    ));
    b.free(x).unwrap();
    let mut l = VirtualBlock::<()>::new_linear(100);
    l.allocate(&req(3), ()).unwrap();
    assert_eq!(l.allocate(&req(5).align(0), ()).unwrap().offset(), 3);
    assert_eq!(
        l.allocate(&req(5).align(0).upper_address(), ())
            .unwrap()
            .offset(),
        95
    );
    let mut buffer = [0u8; 64];
    let base = std::ptr::NonNull::new(buffer.as_mut_ptr()).unwrap();
    let mut f = ExternalMapAllocator::new("align0", base, 64).unwrap();
    let p = f.allocate(7, 0).unwrap();
    f.deallocate(p.as_ptr()).unwrap();
    check_consistent(&b);
    check_consistent(&l);
}

#[test]
fn handles_are_16_bytes_and_still_tell_stale_from_foreign() {
    assert_eq!(std::mem::size_of::<Alloc>(), 16);
    assert_eq!(std::mem::size_of::<Option<Alloc>>(), 16);
    // Many blocks, each with allocations: a handle of one is foreign to every other, and
    // stale once freed in its own.
    let mut blocks: Vec<VirtualBlock<()>> = (0..40).map(|_| VirtualBlock::new(1 << 16)).collect();
    let handles: Vec<Vec<Alloc>> = blocks
        .iter_mut()
        .map(|b| (0..50).map(|_| b.allocate(&req(16), ()).unwrap()).collect())
        .collect();
    for (i, b) in blocks.iter().enumerate() {
        for (j, hs) in handles.iter().enumerate() {
            for &h in hs {
                let expected = if i == j {
                    Ok(16)
                } else {
                    Err(Error::ForeignHandle)
                };
                assert_eq!(b.info(h).map(|x| x.size), expected);
            }
        }
    }
    let b = &mut blocks[7];
    let h = handles[7][3];
    b.free(h).unwrap();
    assert_eq!(b.free(h), Err(Error::StaleHandle));
    // Its record is reused by the next allocation (same offset too): still stale.
    let again = b.allocate(&req(16), ()).unwrap();
    assert_eq!(again.offset(), h.offset());
    assert_ne!(again, h);
    assert_eq!(b.free(h), Err(Error::StaleHandle));
    assert_eq!(blocks[8].free(again), Err(Error::ForeignHandle));
}

#[test]
fn tags_with_names_made_at_run_time() {
    let mut b = VirtualBlock::<()>::new(1 << 20);
    let pools: Vec<Tag> = (0..3).map(|i| Tag::intern(&format!("pool {i}"))).collect();
    for (i, &t) in pools.iter().enumerate() {
        for _ in 0..=i {
            b.allocate(&req(100).tag(t), ()).unwrap();
        }
    }
    // The same name made again, or written as a literal, is the same tag.
    let again = Tag::intern(&String::from("pool 2"));
    assert_eq!(again, pools[2]);
    assert_eq!(again.name().as_ptr(), pools[2].name().as_ptr());
    b.allocate(&req(100).tag(Tag::new("pool 2")), ()).unwrap();
    let stats = b.tag_statistics();
    let counts: Vec<(&str, u32)> = stats
        .iter()
        .map(|t| (t.tag.unwrap().name(), t.allocation_count))
        .collect();
    assert_eq!(counts, [("pool 0", 1), ("pool 1", 2), ("pool 2", 4)]);
    assert!(b.to_json(true).contains("\"Tag\": \"pool 1\""));
    assert!(b.to_svg().contains("pool 0"));
    check_consistent(&b);
}

#[test]
fn zero_sized_block_and_growth_from_zero() {
    let mut b = VirtualBlock::<()>::new(0);
    check_consistent(&b);
    assert!(matches!(
        b.allocate(&req(1), ()),
        Err(Error::OutOfSpace { .. })
    ));
    b.grow(64).unwrap();
    assert_eq!(b.allocate(&req(64), ()).unwrap().offset(), 0);
    check_consistent(&b);
}

#[test]
fn grow_extends_the_free_tail_or_adds_one() {
    let mut b = VirtualBlock::<()>::new(100);
    let a = b.allocate(&req(60), ()).unwrap();
    b.grow(200).unwrap();
    assert_eq!(
        b.detailed_statistics().unused_range_count,
        1,
        "merged with the free tail"
    );
    let c = b.allocate(&req(140), ()).unwrap();
    assert_eq!(c.offset(), 60);
    b.grow(300).unwrap(); // last range is taken: a new free range
    check_consistent(&b);
    b.free(a).unwrap();
    b.free(c).unwrap();
    assert_eq!(b.largest_free(), 300);
    // Huge blocks: u64 sizes beyond 4 Gi.
    b.grow(1 << 50).unwrap();
    assert_eq!(
        b.allocate(&req(1 << 49).align(1 << 40), ())
            .unwrap()
            .offset(),
        0
    );
    check_consistent(&b);
}

#[test]
fn strategies_place_as_documented() {
    // Free ranges of 100 at 0, 300 at 200, 50 at 600 (block 1000, the rest taken).
    let layout = || {
        let mut b = VirtualBlock::<()>::new(1000);
        let all: Vec<Alloc> = [100, 100, 300, 100, 50, 350]
            .iter()
            .map(|&s| b.allocate(&req(s), ()).unwrap())
            .collect();
        for i in [0, 2, 4] {
            b.free(all[i]).unwrap();
        }
        b
    };
    let place = |s: Strategy, size: u64| {
        layout()
            .allocate(&req(size).strategy(s), ())
            .unwrap()
            .offset()
    };
    assert_eq!(
        place(Strategy::MinMemory, 40),
        600,
        "best fit: the 50-unit range"
    );
    assert_eq!(place(Strategy::MinOffset, 40), 0, "lowest offset");
    assert_eq!(place(Strategy::MinOffset, 200), 200);
    // Good fit takes the smallest size class where anything fits.
    assert_eq!(place(Strategy::Balanced, 49), 600);
    assert_eq!(place(Strategy::Balanced, 51), 0);
    assert_eq!(place(Strategy::MinTime, 300), 200);
}

// ---- Linear algorithm.

#[test]
fn linear_stack_and_free_at_once() {
    let mut b = VirtualBlock::<u32>::new_linear(100);
    let a = b.allocate(&req(30), 1).unwrap();
    let c = b.allocate(&req(30).align(8), 2).unwrap();
    assert_eq!((a.offset(), c.offset()), (0, 32));
    b.free(c).unwrap(); // pop
    let d = b.allocate(&req(60), 3).unwrap();
    assert_eq!(d.offset(), 30, "top of the stack reused");
    assert!(matches!(
        b.allocate(&req(20), 4),
        Err(Error::OutOfSpace { .. })
    ));
    b.clear();
    assert_eq!(b.allocate(&req(100), 5).unwrap().offset(), 0);
    check_consistent(&b);
}

#[test]
fn linear_double_stack() {
    let mut b = VirtualBlock::<()>::new_linear(100);
    let lo = b.allocate(&req(40), ()).unwrap();
    let hi = b.allocate(&req(30).upper_address().align(16), ()).unwrap();
    assert_eq!(hi.offset(), 64, "aligned down from the top");
    let hi2 = b.allocate(&req(20).upper_address(), ()).unwrap();
    assert_eq!(hi2.offset(), 44);
    assert!(matches!(
        b.allocate(&req(5), ()),
        Err(Error::OutOfSpace { .. })
    ));
    check_consistent(&b);
    b.free(hi2).unwrap();
    b.free(hi).unwrap();
    assert_eq!(b.allocate(&req(60), ()).unwrap().offset(), 40);
    b.free(lo).unwrap();
    check_consistent(&b);
}

#[test]
fn linear_ring_buffer_wraps_and_unwraps() {
    let mut b = VirtualBlock::<u32>::new_linear(100);
    let mut queue: std::collections::VecDeque<Alloc> = std::collections::VecDeque::new();
    let mut offsets = Vec::new();
    for i in 0..40u32 {
        // Free the oldest when there is no room: FIFO.
        loop {
            match b.allocate(&req(30), i) {
                Ok(a) => {
                    offsets.push(a.offset());
                    queue.push_back(a);
                    break;
                }
                Err(Error::OutOfSpace { .. }) => {
                    let old = queue.pop_front().unwrap();
                    b.free(old).unwrap();
                }
                Err(e) => panic!("{e}"),
            }
            check_consistent(&b);
        }
        if i == 4 {
            // Wrapped: [0, 30) and [30, 60) below the oldest entry at 60.
            assert_eq!(
                b.allocate(&req(1).upper_address(), 0),
                Err(Error::UpperAddressInRing)
            );
        }
    }
    assert_eq!(&offsets[..6], &[0, 30, 60, 0, 30, 60]);
    while let Some(a) = queue.pop_front() {
        b.free(a).unwrap();
        check_consistent(&b);
    }
    assert!(b.is_empty());
}

#[test]
fn linear_hole_in_the_middle_waits_for_the_ends() {
    let mut b = VirtualBlock::<()>::new_linear(90);
    let a: Vec<Alloc> = (0..3).map(|_| b.allocate(&req(30), ()).unwrap()).collect();
    b.free(a[1]).unwrap();
    assert_eq!(b.detailed_statistics().unused_range_count, 1);
    assert!(
        b.allocate(&req(30), ()).is_err(),
        "linear: the middle is not reused"
    );
    b.free(a[2]).unwrap(); // the end reaches the hole: both go
    assert_eq!(b.allocate(&req(60), ()).unwrap().offset(), 30);
    check_consistent(&b);
    assert_eq!(
        b.defrag_pass(&DefragLimits::default()),
        Err(Error::DefragUnsupported)
    );
}

#[test]
fn linear_compacts_dead_entries() {
    let mut b = VirtualBlock::<()>::new_linear(10_000);
    let n = if cfg!(miri) { 80 } else { 1000 };
    let a: Vec<Alloc> = (0..n).map(|_| b.allocate(&req(5), ()).unwrap()).collect();
    // Free all but the first and last: the dead middle gets compacted away.
    for x in &a[1..n - 1] {
        b.free(*x).unwrap();
    }
    check_consistent(&b);
    b.free(a[n - 1]).unwrap();
    assert_eq!(b.allocate(&req(100), ()).unwrap().offset(), 5);
    check_consistent(&b);
}

// ---- Defragmentation.

#[test]
fn defrag_compacts_and_keeps_data() {
    let mut rng = Rng(7);
    let mut b = VirtualBlock::<u64>::new(100_000);
    let mut live: Vec<Alloc> = Vec::new();
    for i in 0..(if cfg!(miri) { 60 } else { 400 }) {
        let size = rng.below(200) + 1;
        live.push(b.allocate(&req(size).align(1 << rng.below(4)), i).unwrap());
        if rng.below(3) == 0 {
            let k = rng.below(live.len() as u64) as usize;
            b.free(live.swap_remove(k)).unwrap();
        }
    }
    let top = |b: &VirtualBlock<u64>| {
        b.ranges()
            .filter(|r| !matches!(r, Range::Free { .. }))
            .map(|r| r.offset() + r.size())
            .max()
            .unwrap_or(0)
    };
    let mut last_top = top(&b);
    let users: BTreeMap<u64, u64> = live
        .iter()
        .map(|&a| (*b.user_data(a).unwrap(), b.info(a).unwrap().size))
        .collect();
    let mut passes = 0;
    loop {
        let moves = b
            .defrag_pass(&DefragLimits {
                max_bytes: 2000,
                max_moves: 16,
            })
            .unwrap();
        if moves.is_empty() {
            break;
        }
        assert!(moves.len() <= 16 && moves.iter().map(Move::size).sum::<u64>() <= 2000);
        check_consistent(&b);
        assert_eq!(
            b.defrag_pass(&DefragLimits::default()),
            Err(Error::DefragPending)
        );
        for m in &moves {
            assert!(m.dst_offset() < m.src_offset());
            let new = b.commit_move(m).unwrap();
            assert_eq!(
                b.free(m.handle()),
                Err(Error::StaleHandle),
                "old handle retired"
            );
            let k = live.iter().position(|&a| a == m.handle()).unwrap();
            live[k] = new;
            assert_eq!(new.offset(), m.dst_offset());
        }
        assert_eq!(b.commit_move(&moves[0]), Err(Error::UnknownMove));
        check_consistent(&b);
        assert!(
            top(&b) <= last_top,
            "compaction never raises the top allocation"
        );
        last_top = top(&b);
        passes += 1;
    }
    assert!(passes > 0);
    let after: BTreeMap<u64, u64> = live
        .iter()
        .map(|&a| (*b.user_data(a).unwrap(), b.info(a).unwrap().size))
        .collect();
    assert_eq!(users, after, "every allocation kept its data and size");
}

#[test]
fn defrag_packs_equal_sizes_completely() {
    // Moves never overlap their source (a GPU copy within one buffer must not), so full
    // packing is guaranteed when every hole below an allocation can hold it.
    let mut b = VirtualBlock::<()>::new(10_000);
    let a: Vec<Alloc> = (0..50).map(|_| b.allocate(&req(24), ()).unwrap()).collect();
    for x in a.iter().step_by(2) {
        b.free(*x).unwrap();
    }
    loop {
        let moves = b.defrag_pass(&DefragLimits::default()).unwrap();
        if moves.is_empty() {
            break;
        }
        for m in &moves {
            b.commit_move(m).unwrap();
        }
    }
    let d = b.detailed_statistics();
    assert_eq!(d.unused_range_count, 1, "all free space at the end");
    assert_eq!(b.fragmentation(), 0.0);
    check_consistent(&b);
}

#[test]
fn defrag_reject_and_stale_source() {
    let mut b = VirtualBlock::<u8>::new(1000);
    let a = b.allocate(&req(100), 1).unwrap();
    let c = b.allocate(&req(100), 2).unwrap();
    let d = b.allocate(&req(100), 3).unwrap();
    b.free(a).unwrap();
    let moves = b.defrag_pass(&DefragLimits::default()).unwrap();
    assert_eq!(
        moves.len(),
        1,
        "only {d:?} fits below itself? no: the top one moves first"
    );
    assert_eq!(moves[0].handle(), d);
    let s = b.statistics();
    assert_eq!(
        (s.allocation_count, s.allocation_bytes),
        (3, 300),
        "reservation counts"
    );
    assert!(b.to_json(true).contains("RESERVED"));
    assert!(b.to_svg().contains("defrag destination"));
    b.reject_move(&moves[0]).unwrap();
    assert_eq!(b.info(d).unwrap().offset, 200, "rejected: stays");
    assert_eq!(b.reject_move(&moves[0]), Err(Error::UnknownMove));
    check_consistent(&b);
    // The source is freed while its move is pending.
    let moves = b.defrag_pass(&DefragLimits::default()).unwrap();
    b.free(moves[0].handle()).unwrap();
    check_consistent(&b);
    assert_eq!(b.commit_move(&moves[0]), Err(Error::StaleHandle));
    assert_eq!(b.pending_moves(), 0);
    check_consistent(&b);
    // A move of another block, and moves forgotten by clear().
    let mut other = VirtualBlock::<u8>::new(10);
    assert_eq!(other.commit_move(&moves[0]), Err(Error::ForeignHandle));
    b.free(c).unwrap();
    let e = b
        .allocate(&req(10).strategy(Strategy::MinOffset), 9)
        .unwrap();
    let _top = b
        .allocate(&req(10).strategy(Strategy::MinOffset), 9)
        .unwrap();
    b.free(e).unwrap();
    let moves = b.defrag_pass(&DefragLimits::default()).unwrap();
    assert!(!moves.is_empty());
    b.clear();
    assert_eq!(b.commit_move(&moves[0]), Err(Error::UnknownMove));
    assert!(!b.contains(e));
    check_consistent(&b);
    // max_moves = 0 proposes nothing.
    assert!(
        b.defrag_pass(&DefragLimits {
            max_bytes: 10,
            max_moves: 0
        })
        .unwrap()
        .is_empty()
    );
}

// ---- JSON and SVG.

#[test]
fn json_escapes_and_matches_vma_shape() {
    let mut b = VirtualBlock::<u64>::new(1000);
    let nasty = "quote\" back\\slash\nnew\ttab \u{1} é 🦀 </svg>";
    b.allocate(&req(10).name(nasty).tag(Tag::new("t\"ag")), 42)
        .unwrap();
    let one: serde_json::Value = serde_json::from_str(&b.to_json(false)).unwrap();
    assert!(one.get("Details").is_none());
    // Min/max fields only when more than one (VMA's rule).
    assert!(one["Stats"].get("AllocationSizeMin").is_none());
    assert!(one["Stats"].get("UnusedRangeSizeMin").is_none());
    let x = b.allocate(&req(20), 7).unwrap();
    b.allocate(&req(30), 8).unwrap();
    b.free(x).unwrap();
    let v: serde_json::Value = serde_json::from_str(&b.to_json_with(true, |u| *u)).unwrap();
    let s = &v["Stats"];
    assert_eq!(s["BlockCount"], 1);
    assert_eq!(s["BlockBytes"], 1000);
    assert_eq!(s["AllocationCount"], 2);
    assert_eq!(s["AllocationBytes"], 40);
    assert_eq!(s["UnusedRangeCount"], 2);
    assert_eq!(
        (
            s["AllocationSizeMin"].clone(),
            s["AllocationSizeMax"].clone()
        ),
        (10.into(), 30.into())
    );
    assert_eq!(
        (
            s["UnusedRangeSizeMin"].clone(),
            s["UnusedRangeSizeMax"].clone()
        ),
        (20.into(), 940.into())
    );
    let d = &v["Details"];
    assert_eq!(
        (d["TotalBytes"].clone(), d["UnusedBytes"].clone()),
        (1000.into(), 960.into())
    );
    let subs = d["Suballocations"].as_array().unwrap();
    assert_eq!(subs.len(), 4);
    assert_eq!(subs[0]["Name"], nasty);
    assert_eq!(subs[0]["Tag"], "t\"ag");
    assert_eq!(subs[0]["CustomData"], 42);
    assert_eq!(subs[1]["Type"], "FREE");
    assert_eq!(
        (subs[1]["Offset"].clone(), subs[1]["Size"].clone()),
        (10.into(), 20.into())
    );
    let empty: serde_json::Value =
        serde_json::from_str(&VirtualBlock::<()>::new(0).to_json(true)).unwrap();
    assert_eq!(
        empty["Details"]["Suballocations"].as_array().unwrap().len(),
        0
    );
}

#[test]
fn svg_has_bars_legend_and_escaped_text() {
    let mut a = VirtualBlock::<()>::new(1 << 20);
    a.set_name("heap <0> & co");
    for i in 0..(if cfg!(miri) { 20 } else { 1000 }) {
        let tag = [Tag::new("textures"), Tag::new("meshes"), Tag::new("a&b")]
            [(i / if cfg!(miri) { 1 } else { 50 }) % 3];
        a.allocate(&req(100 + i as u64).tag(tag).name("n\"x"), ())
            .unwrap();
    }
    a.allocate(&req(1000), ()).unwrap();
    let b = VirtualBlock::<()>::new_linear(4096);
    let svg = memory_map_svg(&[MapRow::new("", &a), MapRow::new("linear", &b)]);
    assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
    assert!(svg.contains("heap &lt;0&gt; &amp; co"));
    assert!(svg.contains("a&amp;b:") && svg.contains("textures:") && svg.contains("untagged:"));
    assert!(svg.contains("free:") && svg.contains("linear"));
    assert!(!svg.contains("n\"x"), "quotes escaped");
    // Balanced tags: every < has a matching > and no raw ampersand survives.
    assert_eq!(svg.matches('<').count(), svg.matches('>').count());
    assert!(svg.split('&').skip(1).all(|s| {
        ["amp;", "lt;", "gt;", "quot;", "apos;"]
            .iter()
            .any(|e| s.starts_with(e))
    }));
    // Alike neighbouring columns are merged: far fewer rectangles than allocations.
    if !cfg!(miri) {
        assert!(svg.matches("<rect").count() < 600);
    }
}

#[test]
fn svg_colours_stay_with_the_tag_and_wide_allocations_show_names() {
    // "textures" keeps its colour whatever other tags share the picture.
    let legend_colour = |svg: &str, name: &str| {
        let at = svg.find(&format!(">{name}: ")).expect("legend entry");
        let fill = svg[..at].rfind("fill=\"").expect("legend swatch") + 6;
        svg[fill..fill + 7].to_string()
    };
    let mut a = VirtualBlock::<()>::new(1 << 20);
    a.allocate(&req(1000).tag(Tag::new("textures")), ())
        .unwrap();
    let mut b = VirtualBlock::<()>::new(1 << 20);
    b.allocate(&req(1000).tag(Tag::new("a first tag")), ())
        .unwrap();
    b.allocate(&req(1000).tag(Tag::intern("textures")), ())
        .unwrap();
    let (sa, sb) = (a.to_svg(), b.to_svg());
    assert_eq!(
        legend_colour(&sa, "textures"),
        legend_colour(&sb, "textures")
    );
    assert_ne!(
        legend_colour(&sb, "textures"),
        legend_colour(&sb, "a first tag")
    );
    // A name shows where it fits, and only there; tooltips name every allocation wide enough.
    let mut c = VirtualBlock::<()>::new(1000);
    c.allocate(&req(500).name("wide enough"), ()).unwrap();
    c.allocate(&req(5).name("too narrow for this name"), ())
        .unwrap();
    let svg = c.to_svg();
    assert!(svg.contains(">wide enough</text>"));
    assert!(!svg.contains(">too narrow for this name</text>"));
    assert!(svg.contains("<title>too narrow for this name @500 +5</title>"));
    // No outlines that could read as gaps.
    assert!(!svg.contains("stroke=\"white\""));
}

// ---- The O3DE facade.

#[test]
fn blocks_and_the_facade_can_move_between_threads() {
    fn send<T: Send>(_: &T) {}
    send(&VirtualBlock::<String>::new(1));
    let mut memory = [0u8; 64];
    let base = std::ptr::NonNull::new(memory.as_mut_ptr()).unwrap();
    let f = ExternalMapAllocator::new("x", base, 64).unwrap();
    send(&f);
    let handle = std::thread::spawn(move || f.capacity());
    assert_eq!(handle.join().unwrap(), 64);
}

#[test]
fn facade_by_pointer() {
    let mut memory = vec![0u8; 4096];
    let base = std::ptr::NonNull::new(memory.as_mut_ptr()).unwrap();
    let mut f = ExternalMapAllocator::new("scratch", base, 4096).unwrap();
    let p = f.allocate(100, 64).unwrap();
    let q = f.allocate(200, 16).unwrap();
    // The pointers keep the buffer's provenance: writing through them is fine (Miri checks).
    // SAFETY: both ranges lie inside `memory`, which outlives them, and do not overlap.
    unsafe {
        p.as_ptr().write_bytes(0xAB, 100);
        q.as_ptr().write_bytes(0xCD, 200);
    }
    assert_eq!(f.allocation_size(p.as_ptr()), Some(100));
    assert_eq!(f.allocation_size(q.as_ptr().wrapping_add(1)), None);
    assert_eq!(f.num_allocated_bytes(), 300);
    assert_eq!(
        f.deallocate(q.as_ptr().wrapping_add(1)),
        Err(Error::UnknownAddress)
    );
    assert_eq!(
        f.deallocate(std::ptr::null_mut()),
        Err(Error::UnknownAddress)
    );
    f.deallocate(p.as_ptr()).unwrap();
    assert_eq!(f.deallocate(p.as_ptr()), Err(Error::UnknownAddress));
    assert!(f.allocate(0, 1).is_err() && f.allocate(1, 3).is_err() && f.allocate(5000, 1).is_err());
    f.garbage_collect();
    let s = f.statistics();
    assert_eq!(
        (
            s.live_bytes,
            s.live_count,
            s.peak_bytes,
            s.total_allocations,
            s.total_deallocations,
            s.failed_allocations,
            s.capacity
        ),
        (200, 1, 300, 2, 1, 3, 4096)
    );
    assert_eq!(f.capacity(), 4096);
    assert_eq!(
        f.max_allocation_size(),
        4096 - 200 - (q.as_ptr() as usize - base.as_ptr() as usize) as u64
    );
    assert_eq!(f.name(), "scratch");
    f.block().validate().unwrap();
    drop(f);
    assert!(memory.contains(&0xCD));
}

#[test]
fn facade_rejects_a_range_that_wraps() {
    let base = std::ptr::NonNull::<u8>::dangling();
    assert_eq!(
        ExternalMapAllocator::new("x", base, u64::MAX).map(|_| ()),
        Err(Error::AddressOverflow)
    );
}

// ---- Property tests against a shadow interval map.

fn config(cases: u32) -> ProptestConfig {
    ProptestConfig {
        cases: if cfg!(miri) { 2 } else { cases },
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

const STEPS: usize = if cfg!(miri) { 30 } else { 160 };

#[derive(Clone, Debug)]
enum Action {
    Alloc {
        size: u64,
        align_log2: u32,
        strategy: u8,
    },
    Free(usize),
    FreeStale(usize),
    Clear,
    Grow(u64),
    Defrag {
        max_moves: u32,
        max_bytes: u64,
        commit_mask: u32,
        free_first: bool,
    },
}

fn action() -> impl proptest::strategy::Strategy<Value = Action> {
    prop_oneof![
        6 => (1u64..400, 0u32..9, 0u8..4).prop_map(|(size, align_log2, strategy)| Action::Alloc { size, align_log2, strategy }),
        1 => (1u64..5000, 0u32..2, 0u8..4).prop_map(|(size, align_log2, strategy)| Action::Alloc { size, align_log2, strategy }),
        4 => any::<usize>().prop_map(Action::Free),
        1 => any::<usize>().prop_map(Action::FreeStale),
        1 => (0u64..600).prop_map(Action::Grow),
        1 => (1u32..10, 1u64..3000, any::<u32>(), any::<bool>())
            .prop_map(|(max_moves, max_bytes, commit_mask, free_first)| Action::Defrag { max_moves, max_bytes, commit_mask, free_first }),
        1 => Just(Action::Clear),
    ]
}

/// Live allocations by offset: (size, align, handle, user).
type Shadow = BTreeMap<u64, (u64, u64, Alloc, u64)>;

fn shadow_gaps(shadow: &Shadow, capacity: u64) -> Vec<(u64, u64)> {
    let mut gaps = Vec::new();
    let mut end = 0;
    for (&o, &(s, ..)) in shadow {
        if o > end {
            gaps.push((end, o - end));
        }
        end = o + s;
    }
    if capacity > end {
        gaps.push((end, capacity - end));
    }
    gaps
}

fn check_against_shadow(b: &VirtualBlock<u64>, shadow: &Shadow) {
    check_consistent(b);
    assert_eq!(b.len(), shadow.len());
    for (&o, &(s, align, h, user)) in shadow {
        let i = b.info(h).unwrap();
        assert_eq!((i.offset, i.size, i.align, *i.user), (o, s, align, user));
    }
    let gaps = shadow_gaps(shadow, b.capacity());
    assert_eq!(b.free_ranges().collect::<Vec<_>>(), gaps);
    let sum: u64 = gaps.iter().map(|g| g.1).sum();
    let squares: u128 = gaps.iter().map(|g| u128::from(g.1) * u128::from(g.1)).sum();
    assert!((b.fragmentation() - stats::fragmentation_metric(sum, squares)).abs() < 1e-9);
}

proptest! {
    #![proptest_config(config(600))]

    /// Random allocate / free / clear / grow / defragment sequences on a TLSF block agree with
    /// a shadow interval map after every step, and an allocation fails exactly when no free
    /// range can hold it (no false out-of-memory).
    #[test]
    fn tlsf_matches_shadow(start in 0u64..3000, actions in proptest::collection::vec(action(), 1..STEPS)) {
        let strategies = [Strategy::Balanced, Strategy::MinTime, Strategy::MinMemory, Strategy::MinOffset];
        let mut b = VirtualBlock::<u64>::new(start);
        let mut shadow = Shadow::new();
        let mut stale: Vec<Alloc> = Vec::new();
        let mut next_user = 0u64;
        for act in actions {
            match act {
                Action::Alloc { size, align_log2, strategy } => {
                    let align = 1u64 << align_log2;
                    let gaps = shadow_gaps(&shadow, b.capacity());
                    let fitting: Vec<(u64, u64)> = gaps.iter().copied().filter(|&(o, s)| o.next_multiple_of(align) + size <= o + s).collect();
                    let strategy = strategies[strategy as usize];
                    next_user += 1;
                    match b.allocate(&req(size).align(align).strategy(strategy), next_user) {
                        Ok(a) => {
                            let o = a.offset();
                            prop_assert_eq!(o % align, 0);
                            let gap = fitting.iter().find(|&&(g, s)| g <= o && o + size <= g + s);
                            prop_assert!(gap.is_some(), "allocation outside every free range");
                            let gap = gap.unwrap();
                            match strategy {
                                Strategy::MinOffset => prop_assert_eq!(o, fitting[0].0.next_multiple_of(align)),
                                // Exact best fit while the walk budget covers every free range.
                                Strategy::MinMemory if gaps.len() <= tlsf::BEST_FIT_BUDGET => {
                                    prop_assert_eq!(gap.1, fitting.iter().map(|g| g.1).min().unwrap())
                                }
                                _ => {}
                            }
                            shadow.insert(o, (size, align, a, next_user));
                        }
                        Err(Error::OutOfSpace { largest_free_at_least: l, free_bytes, .. }) => {
                            prop_assert!(fitting.is_empty(), "false out-of-memory: {:?} fits", fitting);
                            let largest = gaps.iter().map(|g| g.1).max().unwrap_or(0);
                            prop_assert!(l <= largest && largest < l + l / 32 + 1, "{} vs {}", l, largest);
                            prop_assert_eq!(free_bytes, gaps.iter().map(|g| g.1).sum::<u64>());
                        }
                        Err(e) => prop_assert!(false, "unexpected {}", e),
                    }
                }
                Action::Free(k) => {
                    if !shadow.is_empty() {
                        let o = *shadow.keys().nth(k % shadow.len()).unwrap();
                        let (_, _, h, user) = shadow.remove(&o).unwrap();
                        prop_assert_eq!(b.free(h), Ok(user));
                        stale.push(h);
                    }
                }
                Action::FreeStale(k) => {
                    if !stale.is_empty() {
                        prop_assert_eq!(b.free(stale[k % stale.len()]), Err(Error::StaleHandle));
                    }
                }
                Action::Clear => {
                    stale.extend(shadow.values().map(|v| v.2));
                    shadow.clear();
                    b.clear();
                }
                Action::Grow(extra) => {
                    b.grow(b.capacity() + extra).unwrap();
                }
                Action::Defrag { max_moves, max_bytes, commit_mask, free_first } => {
                    let moves = b.defrag_pass(&DefragLimits { max_bytes, max_moves }).unwrap();
                    prop_assert!(moves.len() <= max_moves as usize);
                    prop_assert!(moves.iter().map(Move::size).sum::<u64>() <= max_bytes);
                    check_consistent(&b);
                    let mut dsts: Vec<(u64, u64)> = Vec::new();
                    for m in &moves {
                        let (size, align, h, _) = shadow[&m.src_offset()];
                        prop_assert_eq!((m.handle(), m.size()), (h, size));
                        prop_assert!(m.dst_offset() < m.src_offset() && m.dst_offset() % align == 0);
                        // The destination was free before the pass and is not shared.
                        prop_assert!(shadow.range(..m.dst_offset() + size).next_back().is_none_or(|(&o, v)| o + v.0 <= m.dst_offset()));
                        prop_assert!(dsts.iter().all(|&(o, s)| o + s <= m.dst_offset() || m.dst_offset() + size <= o));
                        dsts.push((m.dst_offset(), size));
                    }
                    for (i, m) in moves.iter().enumerate() {
                        if free_first && i == 0 {
                            let (_, _, h, user) = shadow.remove(&m.src_offset()).unwrap();
                            prop_assert_eq!(b.free(h), Ok(user));
                            prop_assert_eq!(b.commit_move(m), Err(Error::StaleHandle));
                            stale.push(h);
                        } else if commit_mask >> (i % 32) & 1 == 1 {
                            let (size, align, h, user) = shadow.remove(&m.src_offset()).unwrap();
                            let new = b.commit_move(m).unwrap();
                            prop_assert_eq!(new.offset(), m.dst_offset());
                            shadow.insert(new.offset(), (size, align, new, user));
                            stale.push(h);
                        } else {
                            b.reject_move(m).unwrap();
                        }
                    }
                }
            }
            check_against_shadow(&b, &shadow);
        }
    }

    /// Random linear use (stack, double stack, ring, random frees) never overlaps, keeps
    /// alignment and counters, and an empty block always takes what fits.
    #[test]
    fn linear_matches_shadow(cap in 1u64..2000, actions in proptest::collection::vec((0u8..6, 1u64..300, 0u32..6, any::<usize>()), 1..STEPS)) {
        let mut b = VirtualBlock::<u64>::new_linear(cap);
        let mut shadow = Shadow::new();
        let mut order: Vec<Alloc> = Vec::new(); // allocation order
        let mut n = 0u64;
        for (kind, size, align_log2, pick) in actions {
            let align = 1u64 << align_log2;
            match kind {
                0..=2 => {
                    let upper = kind == 2;
                    let was_empty = shadow.is_empty();
                    let mut r = req(size).align(align);
                    if upper { r = r.upper_address(); }
                    n += 1;
                    match b.allocate(&r, n) {
                        Ok(a) => {
                            let o = a.offset();
                            prop_assert_eq!(o % align, 0);
                            prop_assert!(o + size <= b.capacity());
                            prop_assert!(shadow.range(..o + size).next_back().is_none_or(|(&so, v)| so + v.0 <= o), "overlap");
                            shadow.insert(o, (size, align, a, n));
                            order.push(a);
                        }
                        Err(Error::OutOfSpace { largest_free_at_least: l, .. }) => {
                            prop_assert!(!was_empty || size > b.capacity() || (upper && (b.capacity() - size) & !(align - 1) > b.capacity()));
                            // The figure is space the next allocation could take.
                            prop_assert!(l <= b.free_bytes());
                            if align == 1 && !upper {
                                prop_assert!(l < size, "{} units said usable, {} refused", l, size);
                            }
                        }
                        Err(Error::UpperAddressInRing) => prop_assert!(upper),
                        Err(e) => prop_assert!(false, "unexpected {}", e),
                    }
                }
                3 | 4 if !order.is_empty() => {
                    // 3: oldest first (ring), 4: newest first (stack).
                    let a = if kind == 3 { order.remove(0) } else { order.pop().unwrap() };
                    let (_, _, _, user) = shadow.remove(&a.offset()).unwrap();
                    prop_assert_eq!(b.free(a), Ok(user));
                }
                5 if !order.is_empty() => {
                    let a = order.remove(pick % order.len());
                    let (_, _, _, user) = shadow.remove(&a.offset()).unwrap();
                    prop_assert_eq!(b.free(a), Ok(user));
                }
                _ => {
                    if pick % 7 == 0 {
                        b.clear();
                        shadow.clear();
                        order.clear();
                    }
                }
            }
            check_consistent(&b);
            prop_assert_eq!(b.len(), shadow.len());
            for (&o, &(s, _, h, user)) in &shadow {
                let i = b.info(h).unwrap();
                prop_assert_eq!((i.offset, i.size, *i.user), (o, s, user));
            }
        }
    }
}

#[test]
fn churn_never_reports_a_false_oom() {
    // Allocate until the first failure under churn (the benchmark's quality test, small) at
    // several alignments and every strategy: the failure must be genuine.
    for align in [1u64, 16, 256] {
        for strategy in [
            Strategy::Balanced,
            Strategy::MinTime,
            Strategy::MinMemory,
            Strategy::MinOffset,
        ] {
            let mut rng = Rng(align * 31 + strategy as u64 + 1);
            let mut b = VirtualBlock::<()>::new(if cfg!(miri) { 1 << 12 } else { 1 << 17 });
            let mut live: Vec<Alloc> = Vec::new();
            loop {
                if !live.is_empty() && rng.below(3) == 0 {
                    let k = rng.below(live.len() as u64) as usize;
                    b.free(live.swap_remove(k)).unwrap();
                    continue;
                }
                let size = rng.below(2056) + 1;
                match b.allocate(&req(size).align(align).strategy(strategy), ()) {
                    Ok(a) => live.push(a),
                    Err(Error::OutOfSpace { .. }) => {
                        assert!(
                            !fits_somewhere(&b, size, align),
                            "false OOM at align {align}, {strategy:?}"
                        );
                        break;
                    }
                    Err(e) => panic!("{e}"),
                }
            }
            check_consistent(&b);
        }
    }
}

#[test]
fn gpu_mem_dump_parses_and_tiles_each_block() {
    let mut a = VirtualBlock::<u32>::new(10_000);
    let x = a.allocate(&req(100).align(64).name("x"), 5).unwrap();
    a.allocate(&req(300), 6).unwrap();
    a.free(x).unwrap();
    let b = VirtualBlock::<()>::new_linear(500);
    let dump = gpu_mem_dump(
        "gpu",
        &[
            DumpBlock::with("pool", &a, |i| DumpedAllocation {
                custom_data: u64::from(*i.user),
                ..DumpedAllocation::default()
            }),
            DumpBlock::new("ring", &b),
        ],
    );
    let json: serde_json::Value = serde_json::from_str(&dump).unwrap();
    let pools = json["CustomPools"]["Type 0"].as_array().unwrap();
    assert_eq!(pools.len(), 2);
    let subs = pools[0]["Blocks"]["0"]["Suballocations"]
        .as_array()
        .unwrap();
    let tiles: Vec<(u64, &str, u64)> = subs
        .iter()
        .map(|s| {
            (
                s["Offset"].as_u64().unwrap(),
                s["Type"].as_str().unwrap(),
                s["Size"].as_u64().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        tiles,
        [(0, "FREE", 100), (100, "UNKNOWN", 300), (400, "FREE", 9600)]
    );
    assert_eq!(subs[1]["CustomData"], "0x6");
    assert_eq!(json["Total"]["AllocationBytes"], 300);
    assert_eq!(pools[1]["Blocks"]["0"]["UnusedBytes"], 500);
}
