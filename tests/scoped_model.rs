//! A proptest model of scoped tags with tagalloc as the global allocator: random allocations
//! of every size class and of large sizes (own mappings included) inside random scopes or
//! none, on this thread or on threads that exit at once (their blocks outliving them),
//! reallocations across sizes and frees on other threads inside other scopes. At every
//! checkpoint each allocator's live blocks, granted and requested bytes and call counts equal
//! a shadow count; at the end they are back where they started, and every block kept its
//! contents.

mod common;

use proptest::prelude::*;
use std::alloc::Layout;
use tagalloc::{AllocatorStats, SystemAllocator, TagGuard};

#[global_allocator]
static GLOBAL: SystemAllocator = SystemAllocator::new();

tagalloc::allocator!(T0: child of SystemAllocator, "model tag 0 (a parent)");
tagalloc::allocator!(T1: child of SystemAllocator, "model tag 1");
tagalloc::allocator!(T2: child of SystemAllocator, "model tag 2");
tagalloc::allocator!(T3: child of SystemAllocator, "model tag 3");
tagalloc::allocator!(T4: child of SystemAllocator, "model tag 4");
tagalloc::allocator!(T5: child of SystemAllocator, "model tag 5");
tagalloc::allocator!(T6: child of SystemAllocator, "model tag 6");
tagalloc::allocator!(T7: child of SystemAllocator, "model tag 7");
tagalloc::allocator!(G0: child of T0, "model grandchild of tag 0");
tagalloc::allocator!(Lean: child of SystemAllocator { requested_bytes: false }, "model lean tag");

const TAGS: usize = 10;
/// Entering each tag.
const ENTER: [fn() -> TagGuard; TAGS] = [
    || T0.enter(),
    || T1.enter(),
    || T2.enter(),
    || T3.enter(),
    || T4.enter(),
    || T5.enter(),
    || T6.enter(),
    || T7.enter(),
    || G0.enter(),
    || Lean.enter(),
];
/// Each tag's figures.
const STATS: [fn() -> AllocatorStats; TAGS] = [
    || T0.stats(),
    || T1.stats(),
    || T2.stats(),
    || T3.stats(),
    || T4.stats(),
    || T5.stats(),
    || T6.stats(),
    || T7.stats(),
    || G0.stats(),
    || Lean.stats(),
];
/// The tags whose blocks each allocator's figures include (its own and its children's).
fn counted_in(allocator: usize, tag: usize) -> bool {
    allocator == tag || (allocator == 0 && tag == 8)
}
const LEAN: usize = 9;

/// Where an operation runs.
#[derive(Clone, Copy, Debug)]
enum On {
    /// The test's thread.
    Here,
    /// A new thread, which exits right after.
    Thread,
}

#[derive(Clone, Debug)]
enum Op {
    Alloc {
        scope: Option<usize>,
        size: usize,
        align: usize,
        on: On,
    },
    Free {
        which: usize,
        scope: Option<usize>,
        on: On,
    },
    Realloc {
        which: usize,
        size: usize,
        scope: Option<usize>,
        on: On,
    },
    Check,
}

fn size() -> impl Strategy<Value = usize> {
    prop_oneof![
        6 => 1usize..=512,
        3 => 513usize..=4096,
        2 => 4097usize..=300_000,
        1 => Just(17 << 20),
    ]
}

fn scope() -> impl Strategy<Value = Option<usize>> {
    prop_oneof![1 => Just(None), 4 => (0..TAGS).prop_map(Some)]
}

fn on() -> impl Strategy<Value = On> {
    prop_oneof![4 => Just(On::Here), 1 => Just(On::Thread)]
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        5 => (scope(), size(), 0u32..7, on()).prop_map(|(scope, size, a, on)| Op::Alloc {
            scope,
            size,
            align: 1 << a,
            on
        }),
        3 => (any::<usize>(), scope(), on()).prop_map(|(which, scope, on)| Op::Free {
            which,
            scope,
            on
        }),
        2 => (any::<usize>(), size(), scope(), on()).prop_map(|(which, size, scope, on)| {
            Op::Realloc {
                which,
                size,
                scope,
                on,
            }
        }),
        1 => Just(Op::Check),
    ]
}

/// A live block and what the model knows of it.
#[derive(Clone, Copy, Debug)]
struct Block {
    addr: usize,
    layout: Layout,
    /// The tag it was allocated in (`None`: the SystemAllocator's).
    tag: Option<usize>,
    seed: u8,
}

/// What each tag holds and did, by the model.
#[derive(Clone, Copy, Default, Debug)]
struct Shadow {
    blocks: usize,
    granted: usize,
    requested: usize,
    allocations: u64,
    frees: u64,
    reallocations: u64,
}

/// Runs `f` on this thread or on a new one (which exits before this returns), inside the
/// scope of `tag` if any.
fn run<R: Send + 'static>(on: On, tag: Option<usize>, f: impl FnOnce() -> R + Send + 'static) -> R {
    let body = move || {
        let _guard = tag.map(|t| ENTER[t]());
        f()
    };
    match on {
        On::Here => body(),
        On::Thread => std::thread::spawn(body).join().unwrap(),
    }
}

/// Bytes a block's pattern covers: its first 16 and its last.
fn pattern_positions(size: usize) -> impl Iterator<Item = usize> {
    (0..size.min(16)).chain(std::iter::once(size - 1))
}

fn fill(addr: usize, size: usize, seed: u8) {
    for i in pattern_positions(size) {
        // SAFETY: `addr` is a live block of at least `size` bytes.
        unsafe { *(addr as *mut u8).add(i) = seed.wrapping_add(i as u8) };
    }
}

fn check(addr: usize, size: usize, seed: u8) {
    check_within(addr, size, size, seed);
}

/// Checks the pattern of a block of `size` bytes, as far as it lies in the first `kept`.
fn check_within(addr: usize, size: usize, kept: usize, seed: u8) {
    for i in pattern_positions(size).filter(|&i| i < kept) {
        // SAFETY: as in `fill`.
        let byte = unsafe { *(addr as *const u8).add(i) };
        assert_eq!(byte, seed.wrapping_add(i as u8), "block {addr:#x} byte {i}");
    }
}

fn granted(addr: usize, layout: Layout) -> usize {
    // SAFETY: a live block of the global allocator with `layout`.
    unsafe { GLOBAL.usable_size(std::ptr::NonNull::new(addr as *mut u8).unwrap(), layout) }
}

/// Every allocator's figures against the model.
fn assert_matches(start: &[AllocatorStats; TAGS], shadow: &[Shadow; TAGS]) {
    for a in 0..TAGS {
        let mut want = Shadow::default();
        for (t, s) in shadow.iter().enumerate().filter(|(t, _)| counted_in(a, *t)) {
            let _ = t;
            want.blocks += s.blocks;
            want.granted += s.granted;
            want.requested += s.requested;
            want.allocations += s.allocations;
            want.frees += s.frees;
            want.reallocations += s.reallocations;
        }
        let (st, st0) = (STATS[a](), &start[a]);
        assert_eq!(
            st.live_blocks,
            st0.live_blocks + want.blocks,
            "tag {a} blocks"
        );
        assert_eq!(
            st.live_granted_bytes,
            st0.live_granted_bytes + want.granted,
            "tag {a} granted"
        );
        if a == LEAN {
            assert_eq!(st.live_requested_bytes, None);
        } else {
            assert_eq!(
                st.live_requested_bytes.unwrap(),
                st0.live_requested_bytes.unwrap() + want.requested,
                "tag {a} requested"
            );
        }
        assert_eq!(
            st.allocations,
            st0.allocations + want.allocations,
            "tag {a} allocations"
        );
        assert_eq!(st.frees, st0.frees + want.frees, "tag {a} frees");
        assert_eq!(
            st.reallocations,
            st0.reallocations + want.reallocations,
            "tag {a} reallocations"
        );
    }
}

fn run_model(ops: Vec<Op>) {
    let start: [AllocatorStats; TAGS] = std::array::from_fn(|t| STATS[t]());
    let mut shadow = [Shadow::default(); TAGS];
    let mut live: Vec<Block> = Vec::new();
    let mut seed = 0u8;
    for op in ops {
        match op {
            Op::Alloc {
                scope,
                size,
                align,
                on,
            } => {
                let layout = Layout::from_size_align(size, align).unwrap();
                // SAFETY: a non-zero size.
                let addr = run(on, scope, move || unsafe { std::alloc::alloc(layout) }
                    as usize);
                assert_ne!(addr, 0, "out of memory");
                assert_eq!(addr % align, 0);
                seed = seed.wrapping_add(1);
                fill(addr, size, seed);
                if let Some(t) = scope {
                    let s = &mut shadow[t];
                    s.blocks += 1;
                    s.granted += granted(addr, layout);
                    s.requested += size;
                    s.allocations += 1;
                }
                live.push(Block {
                    addr,
                    layout,
                    tag: scope,
                    seed,
                });
            }
            Op::Free { which, scope, on } => {
                if live.is_empty() {
                    continue;
                }
                let b = live.swap_remove(which % live.len());
                check(b.addr, b.layout.size(), b.seed);
                if let Some(t) = b.tag {
                    let s = &mut shadow[t];
                    s.blocks -= 1;
                    s.granted -= granted(b.addr, b.layout);
                    s.requested -= b.layout.size();
                    s.frees += 1;
                }
                let (addr, layout) = (b.addr, b.layout);
                // SAFETY: a live block with this layout, freed once.
                run(on, scope, move || unsafe {
                    std::alloc::dealloc(addr as *mut u8, layout)
                });
            }
            Op::Realloc {
                which,
                size,
                scope,
                on,
            } => {
                if live.is_empty() {
                    continue;
                }
                let i = which % live.len();
                let b = live[i];
                check(b.addr, b.layout.size(), b.seed);
                let old_granted = granted(b.addr, b.layout);
                let (addr, layout) = (b.addr, b.layout);
                // SAFETY: a live block with this layout; the size is non-zero and valid.
                let new = run(on, scope, move || unsafe {
                    std::alloc::realloc(addr as *mut u8, layout, size) as usize
                });
                assert_ne!(new, 0, "out of memory");
                let new_layout = Layout::from_size_align(size, b.layout.align()).unwrap();
                check_within(new, b.layout.size(), size, b.seed);
                if let Some(t) = b.tag {
                    let s = &mut shadow[t];
                    s.granted = s.granted - old_granted + granted(new, new_layout);
                    s.requested = s.requested - b.layout.size() + size;
                    s.reallocations += 1;
                }
                fill(new, size, b.seed);
                live[i] = Block {
                    addr: new,
                    layout: new_layout,
                    ..b
                };
            }
            Op::Check => assert_matches(&start, &shadow),
        }
    }
    assert_matches(&start, &shadow);
    for b in live.drain(..) {
        check(b.addr, b.layout.size(), b.seed);
        if let Some(t) = b.tag {
            let s = &mut shadow[t];
            s.blocks -= 1;
            s.granted -= granted(b.addr, b.layout);
            s.requested -= b.layout.size();
            s.frees += 1;
        }
        // SAFETY: a live block with this layout, freed once.
        unsafe { std::alloc::dealloc(b.addr as *mut u8, b.layout) };
    }
    assert_matches(&start, &shadow);
    for (a, s0) in start.iter().enumerate() {
        let st = STATS[a]();
        assert_eq!(
            (st.live_blocks, st.live_granted_bytes),
            (s0.live_blocks, s0.live_granted_bytes),
            "tag {a} back at the start"
        );
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(common::model_cases(48)))]

    #[test]
    fn scoped_tags_count_exactly_whoever_frees_and_wherever(ops in prop::collection::vec(op(), 1..120)) {
        run_model(ops);
    }
}
