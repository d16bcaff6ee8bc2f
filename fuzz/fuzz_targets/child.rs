//! tagalloc as the global allocator of this binary, with a child of the `SystemAllocator`
//! (`Kid`) and a grandchild (`Grand`), driven through the per-type handle functions
//! (`tagalloc::handle::{allocate, allocate_zeroed, deallocate, grow, shrink}`), through
//! std containers inside the handles' scoped tags (`scope` and `enter`), and through an
//! allocator_api2 `Vec`. Between calls the input turns guarded sampling, budgets (warning
//! or refusing) and allocation records on and off.
//!
//! Checked after every step, against the model: no two live blocks overlap, alignment,
//! contents until freed or resized (zeroed memory reads as zero), and both allocators'
//! live blocks, requested bytes and calls (allocations, frees, reallocations), counted from
//! the start of the input; a refusal only where a refusing budget applies, and never past
//! one. At the end everything is freed and both allocators are back where they started.
#![no_main]

use arbitrary::Arbitrary;
use core::alloc::Layout;
use core::num::NonZeroU32;
use core::ptr::NonNull;
use libfuzzer_sys::fuzz_target;
use tagalloc::{AllocatorStats, BudgetMode, RecordMode, SystemAllocator};
use tagalloc_fuzz::{
    AlignSeed, MAX_OPS, Shadow, SizeSeed, check_aligned, fill, messages, verify, verify_prefix,
    verify_zero,
};

#[global_allocator]
static GLOBAL: SystemAllocator = SystemAllocator::new();

tagalloc::allocator!(Kid: child of SystemAllocator, "the fuzzed child");
tagalloc::allocator!(Grand: child of Kid, "the fuzzed grandchild");

#[derive(Arbitrary, Debug)]
enum Op {
    Alloc {
        grand: bool,
        size: SizeSeed,
        align: AlignSeed,
        zeroed: bool,
    },
    Free {
        pick: u16,
    },
    /// `handle::grow` by `extra` bytes (with a new alignment if `realign`: the moving path).
    Grow {
        pick: u16,
        extra: SizeSeed,
        zeroed: bool,
        realign: Option<AlignSeed>,
    },
    /// `handle::shrink` to `keep` (modulo the size + 1).
    Shrink {
        pick: u16,
        keep: u32,
        realign: Option<AlignSeed>,
    },
    /// Guard one allocation in `every % 4` (0: none) of one allocator.
    Guard {
        grand: bool,
        every: u8,
    },
    /// A budget of `kib` KiB (none if `None`), warning or refusing.
    Budget {
        grand: bool,
        kib: Option<u16>,
        refuse: bool,
    },
    Records {
        grand: bool,
        mode: u8,
    },
    /// A std `Vec` made inside one allocator's scoped tag (with `scope`, or with `enter`
    /// and the guard), kept as a live block of that allocator.
    Scoped {
        grand: bool,
        size: SizeSeed,
        zeroed: bool,
        with_guard: bool,
    },
    /// An allocator_api2 `Vec<u8, Kid>` grown by `pushes` single pushes, then dropped.
    ApiVec {
        pushes: u16,
    },
}

/// One live block of the model.
struct Live {
    grand: bool,
    layout: Layout,
    /// The length the handle returned (the std `Vec`'s length for scoped blocks).
    len: usize,
    id: u64,
    /// Made inside a scope: a std boxed slice, freed by dropping it.
    scoped: bool,
}

/// What the model expects of one allocator, counted from the start of the input.
#[derive(Default, Clone, Copy, Debug, PartialEq, Eq)]
struct Expect {
    blocks: usize,
    requested: usize,
    allocations: u64,
    frees: u64,
    reallocations: u64,
}

fn figures(now: &AllocatorStats, start: &AllocatorStats) -> Expect {
    Expect {
        blocks: now.live_blocks - start.live_blocks,
        requested: now.live_requested_bytes.unwrap() - start.live_requested_bytes.unwrap(),
        allocations: now.allocations - start.allocations,
        frees: now.frees - start.frees,
        reallocations: now.reallocations - start.reallocations,
    }
}

/// The state the input set, so the model knows which refusals are allowed.
#[derive(Default, Clone, Copy)]
struct Budgets {
    /// A refusing budget in bytes, per allocator (0: Kid, 1: Grand).
    refusing: [Option<usize>; 2],
}

impl Budgets {
    /// Whether a request through `grand` (or `Kid`) may be refused: a refusing budget on
    /// its way up.
    fn may_refuse(&self, grand: bool) -> bool {
        self.refusing[0].is_some() || (grand && self.refusing[1].is_some())
    }

    /// After a refused call through `grand` (or `Kid`): checks it was allowed, and returns
    /// the blocks `Kid` handed out and took back on the way. A child refuses after its
    /// parent has granted the block (its budget is on granted bytes) and gives it back
    /// (`Child::account`), so a refusal by Grand's own budget is one allocation and one
    /// free in Kid; a refusal by Kid's budget is counted nowhere.
    fn refused(&self, grand: bool, before: &[AllocatorStats; 2], what: &str, step: usize) -> u64 {
        assert!(
            self.may_refuse(grand),
            "step {step}: {what} refused without a refusing budget"
        );
        let kid = Kid.stats();
        let (a, f) = (
            kid.allocations - before[0].allocations,
            kid.frees - before[0].frees,
        );
        assert_eq!(a, f, "step {step}: {what} refused, yet Kid kept a block");
        assert!(
            a <= u64::from(grand),
            "step {step}: {what} refused after {a} allocations in Kid"
        );
        a
    }

    /// After a successful call that made an allocator's live granted bytes grow: no
    /// refusing budget on the request's way up is exceeded (a budget set below what is
    /// already live refuses growth; it cannot take back what is there).
    fn check_within(&self, grand: bool, before: &[AllocatorStats; 2], step: usize) {
        let now = [Kid.stats(), Grand.stats()];
        for who in [0, usize::from(grand)] {
            if let Some(limit) = self.refusing[who] {
                let grew = now[who].live_granted_bytes > before[who].live_granted_bytes;
                assert!(
                    !grew || now[who].live_granted_bytes <= limit,
                    "step {step}: allocator {who} grew past its refusing budget of {limit}: {:?}",
                    now[who]
                );
            }
        }
    }
}

fn allocate(grand: bool, layout: Layout, zeroed: bool) -> Option<NonNull<[u8]>> {
    use tagalloc::handle::{allocate, allocate_zeroed};
    match (grand, zeroed) {
        (false, false) => allocate(Kid, layout),
        (false, true) => allocate_zeroed(Kid, layout),
        (true, false) => allocate(Grand, layout),
        (true, true) => allocate_zeroed(Grand, layout),
    }
}

/// Frees a model block through its handle or by dropping its boxed slice.
///
/// # Safety
/// `addr` must be the live block `b` of the model.
unsafe fn free(addr: usize, b: &Live) {
    let ptr = NonNull::new(addr as *mut u8).unwrap();
    if b.scoped {
        // SAFETY: the model keeps the parts of a `Box<[u8]>` made with the global allocator.
        drop(unsafe { Box::from_raw(core::ptr::slice_from_raw_parts_mut(ptr.as_ptr(), b.len)) });
    } else if b.grand {
        // SAFETY: a live block of Grand with the layout it has now.
        unsafe { tagalloc::handle::deallocate(Grand, ptr, b.layout) };
    } else {
        // SAFETY: a live block of Kid with the layout it has now.
        unsafe { tagalloc::handle::deallocate(Kid, ptr, b.layout) };
    }
}

/// Puts both allocators back to no guard, no budget, no records.
fn reset() {
    for guarded in [Kid.set_guarded(None), Grand.set_guarded(None)] {
        assert!(guarded, "children of the SystemAllocator can be guarded");
    }
    Kid.set_budget(None, BudgetMode::Warn);
    Grand.set_budget(None, BudgetMode::Warn);
    Kid.set_records(RecordMode::Off);
    Grand.set_records(RecordMode::Off);
}

fuzz_target!(|ops: Vec<Op>| {
    messages();
    reset();
    let (kid_start, grand_start) = (Kid.stats(), Grand.stats());
    let mut live: Shadow<Live> = Shadow::default();
    // Calls through each allocator itself (0: Kid, 1: Grand).
    let mut calls = [Expect::default(); 2];
    let mut budgets = Budgets::default();
    // Grandchild resizes its parent made as moves (its refusing budget), counted in the
    // parent as an allocation and a free instead of a reallocation.
    let mut kid_moves = 0u64;
    // Grandchild requests Kid granted and took back when Grand's budget refused them.
    let mut kid_passes = 0u64;
    for (step, op) in ops.into_iter().take(MAX_OPS).enumerate() {
        let id = step as u64 + 1;
        // Both allocators' figures before the step, for the budget check.
        let before = [Kid.stats(), Grand.stats()];
        match op {
            Op::Alloc {
                grand,
                size,
                align,
                zeroed,
            } => {
                let layout =
                    Layout::from_size_align(size.get(usize::MAX), align.get(1 << 20)).unwrap();
                let Some(block) = allocate(grand, layout, zeroed) else {
                    kid_passes += budgets.refused(grand, &before, &format!("{layout:?}"), step);
                    continue;
                };
                let p = block.cast::<u8>().as_ptr();
                check_aligned(p as usize, layout.align(), "handle allocate");
                assert!(block.len() >= layout.size(), "step {step}: short block");
                if layout.size() == 0 {
                    // A dangling pointer: no block, nothing counted.
                    continue;
                }
                if zeroed {
                    // SAFETY: the block holds `block.len()` bytes.
                    unsafe { verify_zero(p, 0, block.len(), "allocate_zeroed") };
                }
                // SAFETY: as above.
                unsafe { fill(p, layout.size(), id) };
                live.insert(
                    p as usize,
                    block.len(),
                    Live {
                        grand,
                        layout,
                        len: block.len(),
                        id,
                        scoped: false,
                    },
                    "alloc",
                );
                calls[usize::from(grand)].allocations += 1;
                budgets.check_within(grand, &before, step);
            }
            Op::Free { pick } => {
                let Some((addr, b)) = live.take(pick) else {
                    continue;
                };
                // SAFETY: a live block; the pattern covers its requested bytes.
                unsafe {
                    verify(addr as *const u8, b.layout.size(), b.id, "free");
                    free(addr, &b);
                }
                calls[usize::from(b.grand)].frees += 1;
            }
            Op::Grow {
                pick,
                extra,
                zeroed,
                realign,
            } => {
                let Some((addr, b)) = live.take(pick) else {
                    continue;
                };
                // SAFETY: as for `Free`.
                unsafe { verify(addr as *const u8, b.layout.size(), b.id, "before grow") };
                if b.scoped {
                    // Std's blocks are not the handle's to resize: put it back.
                    live.insert(addr, b.len, b, "scoped");
                    continue;
                }
                let align = realign.map_or(b.layout.align(), |a| a.get(1 << 20));
                let new =
                    Layout::from_size_align(b.layout.size() + extra.get(1 << 20), align).unwrap();
                let ptr = NonNull::new(addr as *mut u8).unwrap();
                // SAFETY: a live block of that allocator with its layout; `new` is no smaller.
                let grown = unsafe {
                    if b.grand {
                        tagalloc::handle::grow(Grand, ptr, b.layout, new, zeroed)
                    } else {
                        tagalloc::handle::grow(Kid, ptr, b.layout, new, zeroed)
                    }
                };
                let Some(block) = grown else {
                    kid_passes +=
                        budgets.refused(b.grand, &before, &format!("grow to {new:?}"), step);
                    live.insert(addr, b.len, b, "refused grow");
                    continue;
                };
                let q = block.cast::<u8>().as_ptr();
                check_aligned(q as usize, new.align(), "grow");
                assert!(block.len() >= new.size(), "step {step}: short grown block");
                // SAFETY: the new block holds `block.len()` bytes, the old ones copied.
                unsafe {
                    verify(q, b.layout.size(), b.id, "after grow");
                    if zeroed {
                        verify_zero(q, b.layout.size(), block.len(), "grow_zeroed");
                    }
                }
                // A child with a refusing budget moves a block that grows past its granted
                // size (documented on `Child::reallocate`: the budget is then exact), and
                // counts an allocation and a free; a grandchild's in-place resize may so
                // become a move in its parent.
                let past_granted = new.size() > b.len;
                let moved_by = |who: usize| past_granted && budgets.refusing[who].is_some();
                if b.layout.align() == new.align() && b.grand && !moved_by(1) && moved_by(0) {
                    calls[1].reallocations += 1;
                    kid_moves += 1;
                } else if b.layout.align() == new.align() && moved_by(usize::from(b.grand)) {
                    calls[usize::from(b.grand)].allocations += 1;
                    calls[usize::from(b.grand)].frees += 1;
                } else {
                    count_resize(&mut calls[usize::from(b.grand)], &b.layout, &new);
                }
                // SAFETY: as above.
                unsafe { fill(q, new.size(), id) };
                live.insert(
                    q as usize,
                    block.len(),
                    Live {
                        layout: new,
                        len: block.len(),
                        id,
                        ..b
                    },
                    "grow",
                );
                budgets.check_within(b.grand, &before, step);
            }
            Op::Shrink {
                pick,
                keep,
                realign,
            } => {
                let Some((addr, b)) = live.take(pick) else {
                    continue;
                };
                // SAFETY: as for `Free`.
                unsafe { verify(addr as *const u8, b.layout.size(), b.id, "before shrink") };
                if b.scoped {
                    live.insert(addr, b.len, b, "scoped");
                    continue;
                }
                let align = realign.map_or(b.layout.align(), |a| a.get(1 << 20));
                let new =
                    Layout::from_size_align(keep as usize % (b.layout.size() + 1), align).unwrap();
                let ptr = NonNull::new(addr as *mut u8).unwrap();
                // SAFETY: a live block of that allocator with its layout; `new` is no larger.
                let shrunk = unsafe {
                    if b.grand {
                        tagalloc::handle::shrink(Grand, ptr, b.layout, new)
                    } else {
                        tagalloc::handle::shrink(Kid, ptr, b.layout, new)
                    }
                };
                let Some(block) = shrunk else {
                    // Only a move (new alignment) allocates.
                    kid_passes +=
                        budgets.refused(b.grand, &before, &format!("shrink to {new:?}"), step);
                    live.insert(addr, b.len, b, "refused shrink");
                    continue;
                };
                let q = block.cast::<u8>().as_ptr();
                check_aligned(q as usize, new.align(), "shrink");
                assert!(block.len() >= new.size(), "step {step}: short shrunk block");
                let calls = &mut calls[usize::from(b.grand)];
                if new.size() == 0 {
                    // Freed; a dangling pointer back.
                    calls.frees += 1;
                    continue;
                }
                // SAFETY: the block holds `new.size()` bytes of the old contents.
                unsafe {
                    verify_prefix(q, b.layout.size(), new.size(), b.id, "after shrink");
                    // Refilled at the new length, where later checks take their samples.
                    fill(q, new.size(), b.id);
                }
                count_resize(calls, &b.layout, &new);
                live.insert(
                    q as usize,
                    block.len(),
                    Live {
                        layout: new,
                        len: block.len(),
                        ..b
                    },
                    "shrink",
                );
            }
            Op::Guard { grand, every } => {
                let every = NonZeroU32::new(u32::from(every % 4));
                let set = if grand {
                    Grand.set_guarded(every)
                } else {
                    Kid.set_guarded(every)
                };
                assert!(set, "children of the SystemAllocator can be guarded");
            }
            Op::Budget { grand, kib, refuse } => {
                let bytes = kib.map(|k| usize::from(k) * 1024);
                let mode = if refuse {
                    BudgetMode::Fail
                } else {
                    BudgetMode::Warn
                };
                if grand {
                    Grand.set_budget(bytes, mode);
                } else {
                    Kid.set_budget(bytes, mode);
                }
                budgets.refusing[usize::from(grand)] = bytes.filter(|_| refuse);
            }
            Op::Records { grand, mode } => {
                let mode = match mode % 8 {
                    0..=3 => RecordMode::Off,
                    4 | 5 => RecordMode::Sample {
                        interval: 4096,
                        frames: 0,
                    },
                    6 => RecordMode::Basic,
                    _ => RecordMode::Full { frames: 2 },
                };
                if grand {
                    Grand.set_records(mode);
                } else {
                    Kid.set_records(mode);
                }
            }
            Op::Scoped {
                grand,
                size,
                zeroed,
                with_guard,
            } => {
                let n = size.get(usize::MAX);
                let make = || -> Option<Box<[u8]>> {
                    if zeroed && !budgets.may_refuse(grand) {
                        // std's zeroed path (`alloc_zeroed`); it would abort on a refusal.
                        return Some(vec![0u8; n].into_boxed_slice());
                    }
                    let mut v = Vec::new();
                    // A refusing budget makes the allocation fail: `try_reserve_exact`
                    // reports it instead of aborting.
                    v.try_reserve_exact(n).ok()?;
                    if zeroed {
                        v.resize(n, 0);
                    } else {
                        v.extend((0..n).map(|i| tagalloc_fuzz::pattern(id, i)));
                    }
                    Some(v.into_boxed_slice())
                };
                let made = match (grand, with_guard) {
                    (false, false) => Kid.scope(make),
                    (true, false) => Grand.scope(make),
                    (false, true) => {
                        let _tag = Kid.enter();
                        make()
                    }
                    (true, true) => {
                        let _tag = Grand.enter();
                        make()
                    }
                };
                let Some(boxed) = made else {
                    kid_passes +=
                        budgets.refused(grand, &before, &format!("scoped {n} bytes"), step);
                    continue;
                };
                if n == 0 {
                    continue;
                }
                let p = Box::into_raw(boxed).cast::<u8>();
                if zeroed {
                    // SAFETY: the slice holds `n` bytes.
                    unsafe { verify_zero(p, 0, n, "scoped zeroed") };
                    // SAFETY: as above.
                    unsafe { fill(p, n, id) };
                }
                let layout = Layout::array::<u8>(n).unwrap();
                live.insert(
                    p as usize,
                    n,
                    Live {
                        grand,
                        layout,
                        len: n,
                        id,
                        scoped: true,
                    },
                    "scoped",
                );
                calls[usize::from(grand)].allocations += 1;
                budgets.check_within(grand, &before, step);
            }
            Op::ApiVec { pushes } => {
                let before = Kid.stats();
                let mut v = allocator_api2::vec::Vec::new_in(Kid);
                for i in 0..usize::from(pushes % 2048) {
                    if v.try_reserve(1).is_err() {
                        assert!(
                            budgets.may_refuse(false),
                            "step {step}: a push refused without a refusing budget"
                        );
                        break;
                    }
                    v.push(tagalloc_fuzz::pattern(id, i));
                }
                assert!(
                    v.iter()
                        .enumerate()
                        .all(|(i, &x)| x == tagalloc_fuzz::pattern(id, i)),
                    "step {step}: api Vec lost its contents"
                );
                drop(v);
                // Every block it made is gone again; its calls join the model's.
                let d = figures(&Kid.stats(), &before);
                assert_eq!(
                    (d.blocks, d.requested, d.allocations),
                    (0, 0, d.frees),
                    "step {step}: api Vec left blocks: {d:?}"
                );
                calls[0].allocations += d.allocations;
                calls[0].frees += d.frees;
                calls[0].reallocations += d.reallocations;
            }
        }
        check(
            &live,
            &calls,
            kid_moves,
            kid_passes,
            &kid_start,
            &grand_start,
            step,
        );
    }
    for (addr, b) in live.drain() {
        // SAFETY: as for `Free`.
        unsafe {
            verify(addr as *const u8, b.layout.size(), b.id, "final free");
            free(addr, &b);
        }
    }
    reset();
    let (kid, grand) = (Kid.stats(), Grand.stats());
    for (now, start, who) in [(kid, kid_start, "Kid"), (grand, grand_start, "Grand")] {
        assert_eq!(
            (
                now.live_blocks,
                now.live_granted_bytes,
                now.live_requested_bytes
            ),
            (
                start.live_blocks,
                start.live_granted_bytes,
                start.live_requested_bytes
            ),
            "{who}: everything was freed"
        );
    }
});

/// Counts a resize through the handle: in place it is one reallocation; with a new
/// alignment the handle moves the block (an allocation and a free).
fn count_resize(calls: &mut Expect, old: &Layout, new: &Layout) {
    if old.align() == new.align() {
        calls.reallocations += 1;
    } else {
        calls.allocations += 1;
        calls.frees += 1;
    }
}

/// Both allocators' figures against the model's.
fn check(
    live: &Shadow<Live>,
    calls: &[Expect; 2],
    kid_moves: u64,
    kid_passes: u64,
    kid_start: &AllocatorStats,
    grand_start: &AllocatorStats,
    step: usize,
) {
    let mut own = [Expect::default(); 2];
    for b in live.values() {
        let e = &mut own[usize::from(b.grand)];
        e.blocks += 1;
        e.requested += b.layout.size();
    }
    let mut grand = own[1];
    grand.allocations = calls[1].allocations;
    grand.frees = calls[1].frees;
    grand.reallocations = calls[1].reallocations;
    // The child's figures include its grandchild's.
    let kid = Expect {
        blocks: own[0].blocks + own[1].blocks,
        requested: own[0].requested + own[1].requested,
        allocations: calls[0].allocations + calls[1].allocations + kid_moves + kid_passes,
        frees: calls[0].frees + calls[1].frees + kid_moves + kid_passes,
        reallocations: calls[0].reallocations + calls[1].reallocations - kid_moves,
    };
    let (k, g) = (Kid.stats(), Grand.stats());
    assert_eq!(
        figures(&g, grand_start),
        grand,
        "step {step}: Grand's figures"
    );
    assert_eq!(figures(&k, kid_start), kid, "step {step}: Kid's figures");
    assert!(
        k.live_granted_bytes - kid_start.live_granted_bytes >= kid.requested,
        "step {step}: granted below requested: {k:?} from {kid_start:?}"
    );
}
