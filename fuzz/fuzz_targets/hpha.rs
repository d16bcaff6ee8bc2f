//! One `HphaSchema` heap on the OS layer, driven by the input: allocations (plain, zeroed,
//! tagged), frees, reallocations and collections with layouts from 0 bytes to 2 MiB and
//! alignments up to 1 MiB. After every step the heap's live blocks, granted bytes and call
//! counts equal the model's; every block holds its pattern until freed or resized; at the
//! end, with everything freed and collected, the heap holds nothing from the OS.
#![no_main]

use arbitrary::Arbitrary;
use core::alloc::Layout;
use libfuzzer_sys::fuzz_target;
use tagalloc::os::OsAllocator;
use tagalloc::schema::HphaSchema;
use tagalloc::schema::hpha::MAX_TAGS;
use tagalloc_fuzz::{
    AlignSeed, MAX_OPS, Shadow, SizeSeed, check_aligned, fill, verify, verify_prefix, verify_zero,
};

#[derive(Arbitrary, Debug)]
enum Op {
    Alloc {
        size: SizeSeed,
        align: AlignSeed,
        zeroed: bool,
    },
    /// A small block carries `tag` (tags at or past `MAX_TAGS` must be refused).
    Tagged {
        size: SizeSeed,
        align: AlignSeed,
        tag: u16,
    },
    Free {
        pick: u16,
    },
    Realloc {
        pick: u16,
        size: SizeSeed,
    },
    Collect,
}

struct Live {
    layout: Layout,
    granted: usize,
    id: u64,
}

fuzz_target!(|ops: Vec<Op>| {
    let heap = HphaSchema::new(OsAllocator);
    let mut live: Shadow<Live> = Shadow::default();
    let (mut allocations, mut frees) = (0u64, 0u64);
    for (step, op) in ops.into_iter().take(MAX_OPS).enumerate() {
        let id = step as u64 + 1;
        match op {
            Op::Alloc {
                size,
                align,
                zeroed,
            } => {
                let layout = Layout::from_size_align(size.get(usize::MAX), align.get(1 << 20))
                    .expect("valid layout");
                let block = if zeroed {
                    heap.allocate_zeroed(layout)
                } else {
                    heap.allocate(layout)
                }
                .unwrap_or_else(|| panic!("step {step}: {layout:?} refused"));
                let p = block.ptr.as_ptr();
                check_aligned(p as usize, layout.align(), "alloc");
                assert!(block.size >= layout.size(), "granted below requested");
                if zeroed {
                    // SAFETY: the block holds `block.size` bytes.
                    unsafe { verify_zero(p, 0, block.size, "allocate_zeroed") };
                }
                // SAFETY: as above.
                unsafe { fill(p, layout.size(), id) };
                live.insert(
                    p as usize,
                    block.size,
                    Live {
                        layout,
                        granted: block.size,
                        id,
                    },
                    "alloc",
                );
                allocations += 1;
            }
            Op::Tagged { size, align, tag } => {
                let tag = tag % (MAX_TAGS as u16 + 4);
                let layout = Layout::from_size_align(size.get(usize::MAX), align.get(1 << 20))
                    .expect("valid layout");
                let Some(block) = heap.allocate_tagged(layout, tag) else {
                    assert!(
                        usize::from(tag) >= MAX_TAGS,
                        "step {step}: {layout:?} tag {tag} refused"
                    );
                    continue;
                };
                assert!(
                    usize::from(tag) < MAX_TAGS,
                    "tag {tag} out of range accepted"
                );
                let p = block.ptr.as_ptr();
                check_aligned(p as usize, layout.align(), "tagged");
                assert!(block.size >= layout.size(), "granted below requested");
                // SAFETY: a live block of this heap with this layout.
                let read_back = unsafe { heap.tag_of(block.ptr, layout) };
                assert_eq!(read_back, tag, "tag_of");
                // SAFETY: the block holds `block.size` bytes.
                unsafe { fill(p, layout.size(), id) };
                live.insert(
                    p as usize,
                    block.size,
                    Live {
                        layout,
                        granted: block.size,
                        id,
                    },
                    "tagged",
                );
                allocations += 1;
            }
            Op::Free { pick } => {
                let Some((addr, b)) = live.take(pick) else {
                    continue;
                };
                // SAFETY: a live block; the pattern covers its requested bytes.
                unsafe { verify(addr as *const u8, b.layout.size(), b.id, "free") };
                // SAFETY: a live block of this heap with this layout, freed once.
                unsafe {
                    heap.deallocate(core::ptr::NonNull::new(addr as *mut u8).unwrap(), b.layout)
                };
                frees += 1;
            }
            Op::Realloc { pick, size } => {
                let Some((addr, b)) = live.take(pick) else {
                    continue;
                };
                let new = size.get(usize::MAX);
                // SAFETY: as for `Free`.
                unsafe { verify(addr as *const u8, b.layout.size(), b.id, "before realloc") };
                let ptr = core::ptr::NonNull::new(addr as *mut u8).unwrap();
                // SAFETY: a live block of this heap with this layout; sizes stay far below
                // `isize::MAX`.
                let block = unsafe { heap.reallocate(ptr, b.layout, new) }.unwrap_or_else(|| {
                    panic!("step {step}: realloc of {:?} to {new} refused", b.layout)
                });
                let q = block.ptr.as_ptr();
                check_aligned(q as usize, b.layout.align(), "realloc");
                assert!(block.size >= new, "granted below requested after realloc");
                let kept = b.layout.size().min(new);
                // SAFETY: the new block holds at least `kept` bytes, copied from the old one.
                unsafe { verify_prefix(q, b.layout.size(), kept, b.id, "after realloc") };
                // A resize in place counts nothing. A move counts one allocation and one
                // free, except a block with a mapping of its own moved by `mremap` (the
                // same mapping at a new address), which counts neither: the model cannot
                // tell which from outside, so it takes the heap's word for those two,
                // provided they match.
                let st = heap.stats();
                let (da, df) = (st.allocations - allocations, st.frees - frees);
                assert_eq!(
                    da, df,
                    "step {step}: a realloc counted {da} allocations, {df} frees"
                );
                assert!(da <= 1, "step {step}: a realloc counted {da} allocations");
                assert!(
                    da == 0 || q as usize != addr,
                    "step {step}: an in-place realloc counted as a move"
                );
                allocations += da;
                frees += df;
                let layout = Layout::from_size_align(new, b.layout.align()).unwrap();
                // SAFETY: the block holds `block.size >= new` bytes.
                unsafe { fill(q, new, id) };
                live.insert(
                    q as usize,
                    block.size,
                    Live {
                        layout,
                        granted: block.size,
                        id,
                    },
                    "realloc",
                );
            }
            Op::Collect => {
                heap.garbage_collect();
                heap.validate()
                    .unwrap_or_else(|e| panic!("step {step}: {e}"));
            }
        }
        let st = heap.stats();
        assert_eq!(st.live_blocks, live.len(), "step {step}: live blocks");
        let granted: usize = live.values().map(|b| b.granted).sum();
        assert_eq!(st.granted_bytes, granted, "step {step}: granted bytes");
        assert_eq!(st.small_granted_bytes + st.large_granted_bytes, granted);
        assert_eq!(
            (st.allocations, st.frees),
            (allocations, frees),
            "step {step}: calls"
        );
    }
    for (addr, b) in live.drain() {
        // SAFETY: as for `Free`.
        unsafe {
            verify(addr as *const u8, b.layout.size(), b.id, "final free");
            heap.deallocate(core::ptr::NonNull::new(addr as *mut u8).unwrap(), b.layout);
        }
    }
    heap.validate().expect("valid once empty");
    heap.garbage_collect();
    let st = heap.stats();
    assert_eq!((st.live_blocks, st.granted_bytes), (0, 0));
    assert_eq!(
        (st.segments, st.chunks, st.held_bytes),
        (0, 0, 0),
        "an empty heap holds nothing after a collection: {st:?}"
    );
});
