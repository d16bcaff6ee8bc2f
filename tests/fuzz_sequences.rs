//! Fuzz-style sequences, one harness per schema and one for the global allocator across two
//! threads, fed by a deterministic RNG: random layouts (sizes 0 to 2 MiB, alignments 1 to
//! 1 MiB, skewed towards the small classes), allocations, frees, reallocations and
//! collections in random order. Every live block holds a pattern derived from its id over its
//! requested bytes, verified before it is freed or resized, so an overlap or a lost byte
//! fails at once; every pointer is checked for its alignment.
//!
//! These are the deterministic, stable-toolchain counterpart of the cargo-fuzz targets in
//! `fuzz/` (nightly, libFuzzer; see docs/testing.md, "Fuzzing"): plain tests that run with
//! `cargo test`, where a seed replays a sequence exactly. The seed corpus is [`SEEDS`]; a longer run
//! sets `TAGALLOC_FUZZ_SEEDS` (how many seeds past the corpus) and `TAGALLOC_FUZZ_STEPS`
//! (operations per seed), e.g.
//! `TAGALLOC_FUZZ_SEEDS=2000 TAGALLOC_FUZZ_STEPS=20000 cargo test --release --test fuzz_sequences`.
//! A failure prints the seed, which replays it exactly.

use core::alloc::{GlobalAlloc, Layout};
use core::ptr::NonNull;
use std::alloc::System;
use tagalloc::SystemAllocator;
use tagalloc::os::OsAllocator;
use tagalloc::schema::{HphaSchema, PoolConfig, PoolSchema, ThreadPoolSchema};

/// The seed corpus: seeds that found bugs or cover corners are added here.
const SEEDS: [u64; 8] = [
    1,
    2,
    0xdead_beef,
    0x5eed_0000_0000_0001,
    42,
    7_777_777,
    0x0123_4567_89ab_cdef,
    u64::MAX,
];

fn env(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// The seeds to run: the corpus, then `TAGALLOC_FUZZ_SEEDS` more.
fn seeds() -> Vec<u64> {
    let extra = env("TAGALLOC_FUZZ_SEEDS", 0);
    SEEDS
        .iter()
        .copied()
        .chain((0..extra).map(|i| 0x9e37_79b9_7f4a_7c15u64.wrapping_mul(i + 1000)))
        .collect()
}

fn steps(default: u64) -> usize {
    env("TAGALLOC_FUZZ_STEPS", default) as usize
}

/// xorshift64*: deterministic, no allocation.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Self {
        Self(seed.wrapping_mul(0x2545_f491_4f6c_dd1d) | 1)
    }
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
    /// A size skewed towards the small classes, up to `max`.
    fn size(&mut self, max: usize) -> usize {
        let cap = match self.below(10) {
            0..=4 => 600,
            5..=7 => 8192,
            8 => 300_000,
            _ => 2 << 20,
        };
        self.below(cap.min(max) + 1)
    }
    /// An alignment: mostly small, sometimes up to `max`.
    fn align(&mut self, max: usize) -> usize {
        let log = match self.below(20) {
            0..=13 => self.below(4),
            14..=18 => self.below(13),
            _ => self.below(21),
        };
        (1usize << log).min(max)
    }
}

/// A live block of the model.
struct Live {
    ptr: NonNull<u8>,
    layout: Layout,
    id: u64,
}

fn pattern(id: u64, i: usize) -> u8 {
    (id as usize).wrapping_mul(31).wrapping_add(i) as u8 | 1
}

fn fill(b: &Live) {
    // SAFETY: the block holds `layout.size()` bytes and is ours.
    let bytes = unsafe { core::slice::from_raw_parts_mut(b.ptr.as_ptr(), b.layout.size()) };
    for (i, x) in bytes.iter_mut().enumerate() {
        *x = pattern(b.id, i);
    }
}

fn verify(b: &Live, len: usize, seed: u64) {
    // SAFETY: the block holds at least `len` bytes.
    let bytes = unsafe { core::slice::from_raw_parts(b.ptr.as_ptr(), len) };
    if let Some(i) = (0..len).find(|&i| bytes[i] != pattern(b.id, i)) {
        panic!(
            "seed {seed}: block {} ({:?}) lost byte {i} (another block overlapped it?)",
            b.id, b.layout
        );
    }
}

fn check_aligned(p: NonNull<u8>, l: Layout, seed: u64) {
    assert_eq!(
        p.as_ptr() as usize % l.align(),
        0,
        "seed {seed}: {p:p} not aligned for {l:?}"
    );
}

/// One schema's allocate / deallocate / reallocate, for the generic driver.
trait Heap {
    fn alloc(&self, l: Layout) -> Option<NonNull<u8>>;
    /// # Safety
    /// `p` is a live block of `l`.
    unsafe fn free(&self, p: NonNull<u8>, l: Layout);
    /// # Safety
    /// `p` is a live block of `l`.
    unsafe fn realloc(&self, p: NonNull<u8>, l: Layout, new: usize) -> Option<NonNull<u8>>;
    fn collect(&self) {}
    fn max_size(&self) -> usize {
        usize::MAX
    }
    fn max_align(&self) -> usize {
        1 << 20
    }
}

impl Heap for HphaSchema<OsAllocator> {
    fn alloc(&self, l: Layout) -> Option<NonNull<u8>> {
        self.allocate(l).map(|a| a.ptr)
    }
    unsafe fn free(&self, p: NonNull<u8>, l: Layout) {
        // SAFETY: forwarded.
        unsafe { self.deallocate(p, l) }
    }
    unsafe fn realloc(&self, p: NonNull<u8>, l: Layout, new: usize) -> Option<NonNull<u8>> {
        // SAFETY: forwarded.
        unsafe { self.reallocate(p, l, new) }.map(|a| a.ptr)
    }
    fn collect(&self) {
        self.garbage_collect();
    }
}

impl Heap for PoolSchema<System> {
    fn alloc(&self, l: Layout) -> Option<NonNull<u8>> {
        self.allocate(l).map(|a| a.ptr)
    }
    unsafe fn free(&self, p: NonNull<u8>, l: Layout) {
        // SAFETY: forwarded.
        unsafe { self.deallocate(p, l) }
    }
    unsafe fn realloc(&self, p: NonNull<u8>, l: Layout, new: usize) -> Option<NonNull<u8>> {
        let nl = Layout::from_size_align(new, l.align()).ok()?;
        let q = self.alloc(nl)?;
        // SAFETY: both blocks are live and distinct.
        unsafe {
            core::ptr::copy_nonoverlapping(p.as_ptr(), q.as_ptr(), l.size().min(new));
            self.deallocate(p, l);
        }
        Some(q)
    }
    fn collect(&self) {
        self.garbage_collect();
    }
    fn max_size(&self) -> usize {
        self.config().max_size()
    }
    fn max_align(&self) -> usize {
        self.config().max_align()
    }
}

/// Runs `steps` random operations on `heap` from `seed`, then frees everything.
fn drive(heap: &impl Heap, seed: u64, steps: usize) {
    let mut rng = Rng::new(seed);
    let mut live: Vec<Live> = Vec::new();
    let mut next_id = 0u64;
    for _ in 0..steps {
        match rng.below(100) {
            0..=44 => {
                let l =
                    Layout::from_size_align(rng.size(heap.max_size()), rng.align(heap.max_align()))
                        .unwrap();
                if let Some(p) = heap.alloc(l) {
                    check_aligned(p, l, seed);
                    next_id += 1;
                    let b = Live {
                        ptr: p,
                        layout: l,
                        id: next_id,
                    };
                    fill(&b);
                    live.push(b);
                }
            }
            45..=84 if !live.is_empty() => {
                let b = live.swap_remove(rng.below(live.len()));
                verify(&b, b.layout.size(), seed);
                // SAFETY: a live block of this heap with its layout.
                unsafe { heap.free(b.ptr, b.layout) };
            }
            85..=98 if !live.is_empty() => {
                let i = rng.below(live.len());
                let new = rng.size(heap.max_size());
                let b = &live[i];
                verify(b, b.layout.size(), seed);
                // SAFETY: a live block of this heap with its layout.
                if let Some(q) = unsafe { heap.realloc(b.ptr, b.layout, new) } {
                    let l = Layout::from_size_align(new, b.layout.align()).unwrap();
                    check_aligned(q, l, seed);
                    let kept = b.layout.size().min(new);
                    let moved = Live {
                        ptr: q,
                        layout: l,
                        id: b.id,
                    };
                    verify(&moved, kept, seed);
                    fill(&moved);
                    live[i] = moved;
                }
            }
            _ => heap.collect(),
        }
    }
    for b in live.drain(..) {
        verify(&b, b.layout.size(), seed);
        // SAFETY: a live block of this heap with its layout.
        unsafe { heap.free(b.ptr, b.layout) };
    }
}

#[test]
fn hpha_sequences() {
    for seed in seeds() {
        let heap = HphaSchema::new(OsAllocator);
        drive(&heap, seed, steps(300));
        heap.validate()
            .unwrap_or_else(|e| panic!("seed {seed}: {e}"));
        assert_eq!(heap.stats().live_blocks, 0, "seed {seed}");
    }
}

#[test]
fn pool_sequences() {
    for seed in seeds() {
        let pool = PoolSchema::with_config(System, PoolConfig::DEFAULT.with_name("fuzz"));
        drive(&pool, seed, steps(2000));
        pool.validate()
            .unwrap_or_else(|e| panic!("seed {seed}: {e}"));
        assert_eq!(pool.stats().live_blocks, 0, "seed {seed}");
    }
}

/// Two threads allocate from a thread pool; each frees a random share of its blocks itself
/// and hands the rest to the other thread to free (the remote-free path).
#[test]
fn thread_pool_sequences_across_two_threads() {
    let cfg = PoolConfig::DEFAULT.with_name("fuzz threads");
    for seed in seeds() {
        let mut pool = ThreadPoolSchema::with_config(System, cfg);
        let n = steps(2000);
        two_threads(
            seed,
            n,
            |rng| {
                let l =
                    Layout::from_size_align(rng.size(cfg.max_size()), rng.align(cfg.max_align()))
                        .unwrap();
                pool.allocate(l).map(|a| (a.ptr, l))
            },
            |p, l| {
                // SAFETY: a live block of this pool with its layout (freed once, by one thread).
                unsafe { pool.deallocate(p, l) }
            },
        );
        pool.validate()
            .unwrap_or_else(|e| panic!("seed {seed}: {e}"));
        assert_eq!(pool.stats().live_blocks, 0, "seed {seed}");
    }
}

/// The global allocator's calls (through `GlobalAlloc`, so the harness does not run on it):
/// two threads allocate, reallocate and free random layouts; about a third of each thread's
/// blocks are freed by the other thread.
#[test]
fn global_allocator_sequences_across_two_threads() {
    static A: SystemAllocator = SystemAllocator::new();
    for seed in seeds() {
        two_threads(
            seed,
            steps(200),
            |rng| {
                let l = Layout::from_size_align(rng.size(usize::MAX), rng.align(1 << 20)).unwrap();
                // SAFETY: `alloc` and `realloc` get valid layouts; the block is then ours.
                unsafe {
                    let p = NonNull::new(A.alloc(l))?;
                    if rng.below(4) != 0 {
                        return Some((p, l));
                    }
                    // Resize it once before handing it on.
                    let new = rng.size(usize::MAX).max(1);
                    let b = Live {
                        ptr: p,
                        layout: l,
                        id: 0,
                    };
                    fill(&b);
                    let q = NonNull::new(A.realloc(p.as_ptr(), l, new))?;
                    let nl = Layout::from_size_align(new, l.align()).unwrap();
                    check_aligned(q, nl, seed);
                    verify(
                        &Live {
                            ptr: q,
                            layout: nl,
                            id: 0,
                        },
                        l.size().min(new),
                        seed,
                    );
                    Some((q, nl))
                }
            },
            |p, l| {
                // SAFETY: a live block of `A` with its layout (freed once, by one thread).
                unsafe { A.dealloc(p.as_ptr(), l) }
            },
        );
    }
}

/// Runs `steps` operations on each of two threads: allocate (with `alloc`), fill, and later
/// verify and free (with `free`), either locally or by sending the block to the other
/// thread.
fn two_threads(
    seed: u64,
    steps: usize,
    alloc: impl Fn(&mut Rng) -> Option<(NonNull<u8>, Layout)> + Sync,
    free: impl Fn(NonNull<u8>, Layout) + Sync,
) {
    use std::sync::mpsc::channel;
    struct Sent(usize, Layout, u64);
    let (to_b, from_a) = channel::<Sent>();
    let (to_a, from_b) = channel::<Sent>();
    let run = |side: u64,
               send: std::sync::mpsc::Sender<Sent>,
               recv: std::sync::mpsc::Receiver<Sent>| {
        let mut rng = Rng::new(seed ^ (side << 32));
        let mut live: Vec<Live> = Vec::new();
        let mut id = side << 48;
        let take = |b: Live| {
            verify(&b, b.layout.size(), seed);
            free(b.ptr, b.layout);
        };
        for _ in 0..steps {
            while let Ok(Sent(p, l, i)) = recv.try_recv() {
                take(Live {
                    ptr: NonNull::new(p as *mut u8).unwrap(),
                    layout: l,
                    id: i,
                });
            }
            if rng.below(100) < 55 {
                if let Some((p, l)) = alloc(&mut rng) {
                    check_aligned(p, l, seed);
                    id += 1;
                    let b = Live {
                        ptr: p,
                        layout: l,
                        id,
                    };
                    fill(&b);
                    live.push(b);
                }
            } else if !live.is_empty() {
                let b = live.swap_remove(rng.below(live.len()));
                if rng.below(3) == 0 {
                    verify(&b, b.layout.size(), seed);
                    // The other thread may have finished: then free it here.
                    if let Err(back) = send.send(Sent(b.ptr.as_ptr() as usize, b.layout, b.id)) {
                        let Sent(p, l, i) = back.0;
                        take(Live {
                            ptr: NonNull::new(p as *mut u8).unwrap(),
                            layout: l,
                            id: i,
                        });
                    }
                } else {
                    take(b);
                }
            }
        }
        live.into_iter().for_each(take);
        drop(send);
        // Whatever the other thread still sends.
        for Sent(p, l, i) in recv {
            take(Live {
                ptr: NonNull::new(p as *mut u8).unwrap(),
                layout: l,
                id: i,
            });
        }
    };
    std::thread::scope(|s| {
        s.spawn(|| run(1, to_b, from_b));
        s.spawn(|| run(2, to_a, from_a));
    });
}
