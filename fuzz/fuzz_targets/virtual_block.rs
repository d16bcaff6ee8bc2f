//! The virtual block (offsets in memory tagalloc never touches), TLSF or linear as the input
//! picks, driven by allocations with random sizes, alignments, strategies, tags and
//! upper-address requests, frees (in any order: stack, ring buffer, middle), frees of stale
//! handles, growth and clears.
//!
//! Checked against a model of live ranges after every step: offsets aligned and inside the
//! block, no overlap, the handle's `info` as requested, user data returned by `free`, the
//! block's count and `validate`. Wrong requests get their documented errors, a stale handle
//! is refused without changing anything, and out-of-space is never a false alarm where the
//! model can tell cheaply: an empty block always fits a request up to its capacity, and a
//! TLSF block refuses only when none of its free ranges can hold the request aligned.
#![no_main]

use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;
use std::collections::BTreeMap;
use tagalloc::virtual_block::{
    Algorithm, Alloc, Error, Range, Request, Strategy, Tag, VirtualBlock,
};
use tagalloc_fuzz::MAX_OPS;

#[derive(Arbitrary, Debug)]
enum Op {
    Alloc {
        /// Reduced modulo a range picked by `class` (small, medium, up to the capacity).
        size: u32,
        class: u8,
        /// 2^(`align_log` % 24), or a bad alignment when `align_log` is 255.
        align_log: u8,
        strategy: u8,
        upper: bool,
        tag: Option<u8>,
    },
    Free {
        pick: u16,
    },
    /// Frees the oldest live allocation: the ring-buffer order of a linear block.
    FreeOldest,
    /// Frees the newest: the stack order.
    FreeNewest,
    /// Frees an already freed handle again.
    FreeStale {
        pick: u16,
    },
    Grow {
        extra: u16,
    },
    Clear,
}

#[derive(Arbitrary, Debug)]
struct Input {
    linear: bool,
    capacity: u32,
    ops: Vec<Op>,
}

const TAGS: [Tag; 3] = [
    Tag::new("textures"),
    Tag::new("buffers"),
    Tag::new("meshes"),
];

/// A live allocation of the model.
#[derive(Clone, Copy)]
struct Live {
    handle: Alloc,
    size: u64,
    align: u64,
    /// The user data stored with it (its step), returned by `free`.
    user: u64,
}

fn strategy(pick: u8) -> Strategy {
    match pick % 4 {
        0 => Strategy::Balanced,
        1 => Strategy::MinTime,
        2 => Strategy::MinMemory,
        _ => Strategy::MinOffset,
    }
}

/// Whether a free range of `size` at `offset` holds `want` units aligned to `align`.
fn fits(offset: u64, size: u64, want: u64, align: u64) -> bool {
    let start = offset.next_multiple_of(align);
    start
        .checked_add(want)
        .is_some_and(|end| end <= offset + size)
}

fuzz_target!(|input: Input| {
    let algorithm = if input.linear {
        Algorithm::Linear
    } else {
        Algorithm::Tlsf
    };
    let mut capacity = u64::from(input.capacity % (1 << 24)).max(1);
    let mut block = VirtualBlock::<u64>::with_algorithm(capacity, algorithm);
    // Live allocations by offset; their order of allocation, for the ring and stack frees.
    let mut live: BTreeMap<u64, Live> = BTreeMap::new();
    let mut order: Vec<u64> = Vec::new();
    let mut stale: Vec<Alloc> = Vec::new();
    for (step, op) in input.ops.into_iter().take(MAX_OPS).enumerate() {
        let user = step as u64;
        match op {
            Op::Alloc {
                size,
                class,
                align_log,
                strategy: s,
                upper,
                tag,
            } => {
                let cap = match class % 4 {
                    0 => 64,
                    1 => 4096,
                    2 => 1 << 20,
                    _ => capacity + 16,
                };
                let size = u64::from(size) % (cap + 1);
                let align = if align_log == 255 {
                    48
                } else {
                    1u64 << (align_log % 24)
                };
                let mut req = Request::new(size).align(align).strategy(strategy(s));
                if upper {
                    req = req.upper_address();
                }
                if let Some(t) = tag {
                    req = req.tag(TAGS[usize::from(t) % TAGS.len()]);
                }
                let was_empty = live.is_empty();
                match block.allocate(&req, user) {
                    Ok(handle) => {
                        assert!(
                            size > 0 && align.is_power_of_two(),
                            "step {step}: accepted {req:?}"
                        );
                        assert!(
                            !upper || input.linear,
                            "step {step}: upper address on TLSF accepted"
                        );
                        let offset = handle.offset();
                        assert_eq!(
                            offset % align,
                            0,
                            "step {step}: offset {offset} not aligned to {align}"
                        );
                        assert!(
                            offset + size <= capacity,
                            "step {step}: {offset}+{size} past {capacity}"
                        );
                        if let Some((&before, b)) = live.range(..=offset).next_back() {
                            assert!(
                                before + b.size <= offset,
                                "step {step}: {offset}+{size} overlaps {before}+{}",
                                b.size
                            );
                        }
                        if let Some((&after, a)) = live.range(offset..).next() {
                            assert!(
                                offset + size <= after,
                                "step {step}: {offset}+{size} overlaps {after}+{}",
                                a.size
                            );
                        }
                        let info = block.info(handle).expect("a fresh handle is live");
                        assert_eq!(
                            (info.offset, info.size, info.align, *info.user),
                            (offset, size, align, user)
                        );
                        assert_eq!(info.tag, tag.map(|t| TAGS[usize::from(t) % TAGS.len()]));
                        live.insert(
                            offset,
                            Live {
                                handle,
                                size,
                                align,
                                user,
                            },
                        );
                        order.push(offset);
                    }
                    Err(Error::ZeroSize) => assert_eq!(size, 0, "step {step}"),
                    Err(Error::BadAlignment(a)) => {
                        assert!(a == align && !align.is_power_of_two(), "step {step}")
                    }
                    Err(Error::UpperAddressNotLinear) => {
                        assert!(upper && !input.linear, "step {step}")
                    }
                    Err(Error::UpperAddressInRing) => assert!(upper && input.linear, "step {step}"),
                    Err(Error::OutOfSpace {
                        size: s,
                        align: a,
                        free_bytes,
                        ..
                    }) => {
                        assert_eq!((s, a), (size, align), "step {step}");
                        assert!(
                            !upper || input.linear,
                            "step {step}: upper on TLSF reported as out of space"
                        );
                        let used: u64 = live.values().map(|b| b.size).sum();
                        assert_eq!(free_bytes, capacity - used, "step {step}: free units");
                        // An empty block fits anything up to its size (offset 0 is aligned).
                        assert!(
                            !(was_empty && size <= capacity),
                            "step {step}: false out of space on an empty block: {req:?} in {capacity}"
                        );
                        if !input.linear {
                            // TLSF promises no false out-of-memory: no free range fits.
                            let fitting = block.ranges().find(|r| {
                                matches!(r, Range::Free { .. })
                                    && fits(r.offset(), r.size(), size, align)
                            });
                            if let Some(r) = fitting {
                                panic!(
                                    "step {step}: {req:?} refused though free range {}+{} fits it",
                                    r.offset(),
                                    r.size()
                                );
                            }
                        }
                    }
                    Err(e) => panic!("step {step}: unexpected {e:?} for {req:?}"),
                }
            }
            Op::Free { pick } => {
                if live.is_empty() {
                    continue;
                }
                let offset = *live.keys().nth(usize::from(pick) % live.len()).unwrap();
                free(&mut block, &mut live, &mut order, &mut stale, offset, step);
            }
            Op::FreeOldest => {
                if let Some(&offset) = order.first() {
                    free(&mut block, &mut live, &mut order, &mut stale, offset, step);
                }
            }
            Op::FreeNewest => {
                if let Some(&offset) = order.last() {
                    free(&mut block, &mut live, &mut order, &mut stale, offset, step);
                }
            }
            Op::FreeStale { pick } => {
                if stale.is_empty() {
                    continue;
                }
                let handle = stale[usize::from(pick) % stale.len()];
                assert_eq!(
                    block.free(handle),
                    Err(Error::StaleHandle),
                    "step {step}: a stale handle freed"
                );
                assert!(!block.contains(handle));
            }
            Op::Grow { extra } => {
                assert!(matches!(
                    block.grow(capacity - 1),
                    Err(Error::CannotShrink { .. })
                ));
                capacity += u64::from(extra);
                block.grow(capacity).expect("growing");
                assert_eq!(block.capacity(), capacity);
            }
            Op::Clear => {
                block.clear();
                stale.extend(live.values().map(|b| b.handle));
                live.clear();
                order.clear();
            }
        }
        assert_eq!(block.len(), live.len(), "step {step}: live count");
        if step % 8 == 0 {
            block
                .validate()
                .unwrap_or_else(|e| panic!("step {step}: {e:?}"));
        }
        // Keep the stale list short: checking one is O(1), the list is only a source.
        if stale.len() > 64 {
            stale.drain(..32);
        }
    }
    block.validate().expect("valid at the end");
    // The ranges cover the block: live allocations where the model has them.
    let mut end = 0;
    for r in block.ranges() {
        assert_eq!(r.offset(), end, "ranges leave a gap");
        if let Range::Allocation(a) = &r {
            let b = live
                .get(&a.offset)
                .expect("an allocation the model does not know");
            assert_eq!((a.size, a.align, *a.user), (b.size, b.align, b.user));
        }
        end = r.offset() + r.size();
    }
    assert_eq!(end, capacity, "ranges end at the capacity");
    for offset in order.clone() {
        free(
            &mut block,
            &mut live,
            &mut order,
            &mut stale,
            offset,
            usize::MAX,
        );
    }
    assert!(block.is_empty());
    // Empty again: the whole block is one allocation's worth.
    let whole = block
        .allocate(&Request::new(capacity), 0)
        .expect("an empty block fits its capacity");
    assert_eq!(whole.offset(), 0);
});

/// Frees the live allocation at `offset`, checking its user data comes back and its handle
/// goes stale.
fn free(
    block: &mut VirtualBlock<u64>,
    live: &mut BTreeMap<u64, Live>,
    order: &mut Vec<u64>,
    stale: &mut Vec<Alloc>,
    offset: u64,
    step: usize,
) {
    let b = live.remove(&offset).expect("a live offset");
    order.retain(|&o| o != offset);
    assert_eq!(
        block.free(b.handle),
        Ok(b.user),
        "step {step}: free of {offset}+{}",
        b.size
    );
    assert!(
        !block.contains(b.handle),
        "step {step}: freed handle still live"
    );
    stale.push(b.handle);
}
