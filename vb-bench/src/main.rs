//! Benchmarks tagalloc's virtual block against `offset-allocator`, `rlsf` and `range-alloc`.
//!
//! Two workloads, every contender in the same run, interleaved and repeated, medians reported:
//!
//! 1. **VMA replica** (`TestVirtualBlocksAlgorithmsBenchmark`): 7200 allocations of 1..=2056
//!    units in a block of 2.5 × their sum, then 14 400 random operations (half allocate, half
//!    free a random live one), then free all; alignments 1, 16, 64, 256. Reports ns per
//!    operation for each phase and overall.
//! 2. **Churn to the first failure**: a 4 Mi-unit block; each step frees a random live
//!    allocation with probability 1/3, otherwise allocates 1..=2056 units; stops at the first
//!    failed allocation. Reports utilisation (live requested units / capacity) and counts
//!    false out-of-memory failures: a failure while some free range of the allocator could
//!    hold the request after alignment.
//!
//! Fairness: the same pre-generated random sequence for everyone; offset-allocator has no
//! alignment, so it is asked for `size + align - 1` and the offset rounded up (as its issue #3
//! suggests); rlsf keeps headers inside the managed memory, so it works on a real,
//! pre-faulted buffer and its false-OOM count is not defined.
//!
//! Usage: `cargo run --release -p vb-bench [repetitions] [churn seeds]`.

use std::alloc::Layout;
use std::collections::BTreeMap;
use std::hint::black_box;
use std::mem::MaybeUninit;
use std::ptr::NonNull;
use std::time::Instant;

use tagalloc::virtual_block::{Alloc, Request, Strategy, VirtualBlock};

/// One allocator under test. `alloc` returns the handle, the aligned offset, and the range
/// the allocator really holds for it (start, length), which may include padding.
trait Contender {
    type Handle: Copy;
    fn name(&self) -> String;
    fn alloc(&mut self, size: u64, align: u64) -> Option<(Self::Handle, u64, (u64, u64))>;
    fn free(&mut self, h: Self::Handle);
    /// Whether false out-of-memory can be judged from the held ranges.
    fn exact_ranges(&self) -> bool {
        true
    }
}

struct Tag {
    block: VirtualBlock<()>,
    strategy: Strategy,
}

impl Tag {
    fn new(capacity: u64, strategy: Strategy) -> Self {
        Tag {
            block: VirtualBlock::new(capacity),
            strategy,
        }
    }
}

impl Contender for Tag {
    type Handle = Alloc;
    fn name(&self) -> String {
        format!("tagalloc {:?}", self.strategy)
    }
    #[inline]
    fn alloc(&mut self, size: u64, align: u64) -> Option<(Alloc, u64, (u64, u64))> {
        let a = self
            .block
            .allocate(&Request::new(size).align(align).strategy(self.strategy), ())
            .ok()?;
        Some((a, a.offset(), (a.offset(), size)))
    }
    #[inline]
    fn free(&mut self, h: Alloc) {
        let _ = self.block.free(h);
    }
}

struct OffsetAlloc(offset_allocator::Allocator);

impl OffsetAlloc {
    fn new(capacity: u64) -> Self {
        let cap = u32::try_from(capacity).expect("offset-allocator is 32-bit");
        OffsetAlloc(offset_allocator::Allocator::with_max_allocs(cap, 1 << 20))
    }
}

impl Contender for OffsetAlloc {
    type Handle = offset_allocator::Allocation;
    fn name(&self) -> String {
        "offset-allocator 0.2".into()
    }
    #[inline]
    fn alloc(&mut self, size: u64, align: u64) -> Option<(Self::Handle, u64, (u64, u64))> {
        let padded = u32::try_from(size + align - 1).ok()?;
        let a = self.0.allocate(padded)?;
        let raw = u64::from(a.offset);
        Some((a, raw.next_multiple_of(align), (raw, u64::from(padded))))
    }
    #[inline]
    fn free(&mut self, h: Self::Handle) {
        self.0.free(h);
    }
}

type RlsfTlsf = rlsf::Tlsf<'static, u32, u32, 28, 32>;

struct Rlsf {
    tlsf: RlsfTlsf,
    base: usize,
    /// The managed memory; `tlsf` points into it, so it is declared (and dropped) after it.
    _pool: Box<[MaybeUninit<u8>]>,
}

impl Rlsf {
    fn new(capacity: u64) -> Self {
        let len = usize::try_from(capacity).expect("pool fits in memory");
        // Pre-fault the pool so first-touch page faults are not timed.
        let mut pool: Box<[MaybeUninit<u8>]> = vec![MaybeUninit::new(0u8); len].into_boxed_slice();
        let ptr = NonNull::new(std::ptr::slice_from_raw_parts_mut(
            pool.as_mut_ptr().cast::<u8>(),
            len,
        ))
        .expect("non-null pool");
        let mut tlsf = RlsfTlsf::new();
        // SAFETY: the pool is valid for reads and writes, is not used by anything else, and
        // outlives `tlsf` (both live in this struct; `tlsf` is dropped first and rlsf does not
        // touch the memory when dropped). Moving the Box does not move its heap buffer.
        unsafe { tlsf.insert_free_block_ptr(ptr) };
        Rlsf {
            base: ptr.as_ptr().cast::<u8>() as usize,
            tlsf,
            _pool: pool,
        }
    }
}

impl Contender for Rlsf {
    type Handle = (NonNull<u8>, usize);
    fn name(&self) -> String {
        "rlsf 0.2 (in-band)".into()
    }
    #[inline]
    fn alloc(&mut self, size: u64, align: u64) -> Option<(Self::Handle, u64, (u64, u64))> {
        let layout = Layout::from_size_align(size as usize, align as usize).ok()?;
        let p = self.tlsf.allocate(layout)?;
        let off = (p.as_ptr() as usize - self.base) as u64;
        Some(((p, align as usize), off, (off, size)))
    }
    #[inline]
    fn free(&mut self, (p, align): Self::Handle) {
        // SAFETY: `p` came from `allocate` on this `tlsf` with this alignment and is freed once.
        unsafe { self.tlsf.deallocate(p, align) };
    }
    fn exact_ranges(&self) -> bool {
        false
    }
}

struct RangeAlloc(range_alloc::RangeAllocator<u64>);

impl Contender for RangeAlloc {
    type Handle = (u64, u64);
    fn name(&self) -> String {
        "range-alloc 0.1".into()
    }
    #[inline]
    fn alloc(&mut self, size: u64, align: u64) -> Option<(Self::Handle, u64, (u64, u64))> {
        let r = if align == 1 {
            self.0.allocate_range(size).ok()?
        } else {
            self.0.allocate_range_aligned(size, align).ok()?
        };
        Some(((r.start, r.end), r.start, (r.start, size)))
    }
    #[inline]
    fn free(&mut self, (start, end): Self::Handle) {
        self.0.free_range(start..end);
    }
}

/// xorshift64*: the same sequence for every contender.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
}

const MAX_SIZE: u64 = 2056;
const FIRST_ALLOCS: usize = 7200;
const RANDOM_OPS: usize = 14_400;

/// The pre-generated VMA replica workload.
struct Replica {
    first_sizes: Vec<u64>,
    /// Random ops: (allocate?, size or index seed).
    ops: Vec<(bool, u64)>,
    capacity: u64,
}

impl Replica {
    fn new(seed: u64) -> Self {
        let mut rng = Rng(seed);
        let first_sizes: Vec<u64> = (0..FIRST_ALLOCS)
            .map(|_| rng.next() % MAX_SIZE + 1)
            .collect();
        let ops = (0..RANDOM_OPS)
            .map(|_| {
                let alloc = rng.next() % 2 == 0;
                (
                    alloc,
                    if alloc {
                        rng.next() % MAX_SIZE + 1
                    } else {
                        rng.next()
                    },
                )
            })
            .collect();
        let sum: u64 = first_sizes.iter().sum();
        Replica {
            first_sizes,
            ops,
            capacity: sum * 5 / 2,
        }
    }
}

/// ns/op for the three phases and overall; and failed allocations.
#[derive(Clone, Copy, Default)]
struct ReplicaResult {
    alloc: f64,
    random: f64,
    free: f64,
    /// Allocations left for the free phase.
    remaining: usize,
    failures: u64,
}

fn run_replica<C: Contender>(c: &mut C, w: &Replica, align: u64) -> ReplicaResult {
    let mut live: Vec<C::Handle> = Vec::with_capacity(FIRST_ALLOCS * 2);
    let mut failures = 0;
    let t0 = Instant::now();
    for &s in &w.first_sizes {
        match c.alloc(s, align) {
            Some((h, off, _)) => {
                black_box(off);
                live.push(h);
            }
            None => failures += 1,
        }
    }
    let t1 = Instant::now();
    for &(is_alloc, x) in &w.ops {
        if is_alloc || live.is_empty() {
            match c.alloc(if is_alloc { x } else { 1 }, align) {
                Some((h, off, _)) => {
                    black_box(off);
                    live.push(h);
                }
                None => failures += 1,
            }
        } else {
            let i = (x % live.len() as u64) as usize;
            c.free(live.swap_remove(i));
        }
    }
    let t2 = Instant::now();
    let remaining = live.len();
    for h in live.drain(..) {
        c.free(h);
    }
    let t3 = Instant::now();
    let ns = |a: Instant, b: Instant, n: usize| (b - a).as_nanos() as f64 / n.max(1) as f64;
    ReplicaResult {
        alloc: ns(t0, t1, FIRST_ALLOCS),
        random: ns(t1, t2, RANDOM_OPS),
        free: ns(t2, t3, remaining),
        remaining,
        failures,
    }
}

/// Utilisation at the first failure and whether that failure was false.
struct ChurnResult {
    utilisation: f64,
    false_oom: bool,
}

const CHURN_CAPACITY: u64 = 4 << 20;

fn run_churn<C: Contender>(c: &mut C, seed: u64, align: u64) -> ChurnResult {
    let mut rng = Rng(seed);
    // Live allocations: handle, requested size, held range.
    let mut live: Vec<(C::Handle, u64, (u64, u64))> = Vec::new();
    let mut held: BTreeMap<u64, u64> = BTreeMap::new();
    let mut live_bytes = 0u64;
    loop {
        if !live.is_empty() && rng.next() % 3 == 0 {
            let i = (rng.next() % live.len() as u64) as usize;
            let (h, size, range) = live.swap_remove(i);
            c.free(h);
            held.remove(&range.0);
            live_bytes -= size;
            continue;
        }
        let size = rng.next() % MAX_SIZE + 1;
        match c.alloc(size, align) {
            Some((h, _, range)) => {
                held.insert(range.0, range.1);
                live.push((h, size, range));
                live_bytes += size;
            }
            None => {
                let false_oom =
                    c.exact_ranges() && fits_in_gaps(&held, CHURN_CAPACITY, size, align);
                for (h, ..) in live {
                    c.free(h);
                }
                return ChurnResult {
                    utilisation: live_bytes as f64 / CHURN_CAPACITY as f64,
                    false_oom,
                };
            }
        }
    }
}

/// Whether a gap between held ranges can hold `size` at `align`.
fn fits_in_gaps(held: &BTreeMap<u64, u64>, capacity: u64, size: u64, align: u64) -> bool {
    let mut end = 0u64;
    let fits = |from: u64, to: u64| from.next_multiple_of(align) + size <= to;
    for (&o, &len) in held {
        if o > end && fits(end, o) {
            return true;
        }
        end = o + len;
    }
    end < capacity && fits(end, capacity)
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

const ALIGNS: [u64; 4] = [1, 16, 64, 256];
const CONTENDERS: [&str; 6] = [
    "tagalloc Balanced",
    "tagalloc MinTime",
    "tagalloc MinMemory",
    "offset-allocator 0.2",
    "rlsf 0.2 (in-band)",
    "range-alloc 0.1",
];

/// Runs the replica twice on one instance and keeps the second run: every run ends with
/// everything freed, so the second run sees warmed-up metadata (no first-touch page faults),
/// the steady state a long-lived block lives in.
fn warm<C: Contender>(mut c: C, w: &Replica, align: u64) -> ReplicaResult {
    let first = run_replica(&mut c, w, align);
    let mut second = run_replica(&mut c, w, align);
    second.failures = second.failures.max(first.failures);
    second
}

fn replica_for(k: usize, w: &Replica, align: u64) -> ReplicaResult {
    match k {
        0 => warm(Tag::new(w.capacity, Strategy::Balanced), w, align),
        1 => warm(Tag::new(w.capacity, Strategy::MinTime), w, align),
        2 => warm(Tag::new(w.capacity, Strategy::MinMemory), w, align),
        3 => warm(OffsetAlloc::new(w.capacity), w, align),
        4 => warm(Rlsf::new(w.capacity), w, align),
        _ => warm(
            RangeAlloc(range_alloc::RangeAllocator::new(0..w.capacity)),
            w,
            align,
        ),
    }
}

fn churn_for(k: usize, seed: u64, align: u64) -> ChurnResult {
    match k {
        0 => run_churn(
            &mut Tag::new(CHURN_CAPACITY, Strategy::Balanced),
            seed,
            align,
        ),
        1 => run_churn(
            &mut Tag::new(CHURN_CAPACITY, Strategy::MinTime),
            seed,
            align,
        ),
        2 => run_churn(
            &mut Tag::new(CHURN_CAPACITY, Strategy::MinMemory),
            seed,
            align,
        ),
        3 => run_churn(&mut OffsetAlloc::new(CHURN_CAPACITY), seed, align),
        4 => run_churn(&mut Rlsf::new(CHURN_CAPACITY), seed, align),
        _ => run_churn(
            &mut RangeAlloc(range_alloc::RangeAllocator::new(0..CHURN_CAPACITY)),
            seed,
            align,
        ),
    }
}

fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|m| m.trim().to_string())
        })
        .unwrap_or_else(|| "unknown CPU".into())
}

fn main() {
    let mut args = std::env::args().skip(1);
    let reps: usize = args.next().and_then(|a| a.parse().ok()).unwrap_or(7);
    let seeds: u64 = args.next().and_then(|a| a.parse().ok()).unwrap_or(20);
    // VB_ONLY=<rows, e.g. 0,3> runs just those contenders (for profiling).
    let only: Option<Vec<usize>> = std::env::var("VB_ONLY")
        .ok()
        .map(|v| v.split(',').filter_map(|k| k.trim().parse().ok()).collect());
    let wanted = |k: usize| only.as_ref().is_none_or(|o| o.contains(&k));
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    println!("# Virtual block benchmark");
    println!();
    println!(
        "{} ({threads} threads), {reps} repetitions (medians), {seeds} churn seeds.",
        cpu_model()
    );
    // Check the contenders' names match the table labels.
    debug_assert_eq!(Tag::new(1, Strategy::Balanced).name(), CONTENDERS[0]);
    debug_assert_eq!(OffsetAlloc::new(1).name(), CONTENDERS[3]);
    debug_assert_eq!(Rlsf::new(4096).name(), CONTENDERS[4]);
    debug_assert_eq!(
        RangeAlloc(range_alloc::RangeAllocator::new(0..1)).name(),
        CONTENDERS[5]
    );

    println!();
    println!(
        "## VMA virtual-block benchmark replica (ns/op: allocate phase / random phase / free phase = overall)"
    );
    println!();
    print!("| allocator |");
    for a in ALIGNS {
        print!(" align {a} |");
    }
    println!(" failed allocations |");
    println!("|---|{}---|", "---|".repeat(ALIGNS.len()));
    let w = Replica::new(0x5eed_1234_abcd);
    // samples[k][align] = repetitions
    let mut samples: Vec<Vec<Vec<ReplicaResult>>> =
        vec![vec![Vec::new(); ALIGNS.len()]; CONTENDERS.len()];
    for rep in 0..reps {
        for (ai, &align) in ALIGNS.iter().enumerate() {
            // Rotate the order each repetition so no contender always runs first.
            for j in 0..CONTENDERS.len() {
                let k = (j + rep) % CONTENDERS.len();
                if wanted(k) {
                    samples[k][ai].push(replica_for(k, &w, align));
                }
            }
        }
    }
    for (k, name) in CONTENDERS.iter().enumerate() {
        if !wanted(k) {
            continue;
        }
        print!("| {name} |");
        let mut failures = 0;
        for per_align in &samples[k] {
            let med = |f: fn(&ReplicaResult) -> f64| {
                median(&mut per_align.iter().map(f).collect::<Vec<_>>())
            };
            failures += per_align.iter().map(|r| r.failures).max().unwrap_or(0);
            // Overall: the phase medians weighted by their operation counts. (A median of
            // whole-run totals is at the mercy of one preemption on a busy machine.)
            let (a, r, f) = (med(|r| r.alloc), med(|r| r.random), med(|r| r.free));
            let left = med(|r| r.remaining as f64);
            let ops = FIRST_ALLOCS as f64 + RANDOM_OPS as f64 + left;
            let overall = (a * FIRST_ALLOCS as f64 + r * RANDOM_OPS as f64 + f * left) / ops;
            print!(" {a:.1} / {r:.1} / {f:.1} = **{overall:.1}** |");
        }
        println!(" {failures} |");
    }

    if seeds == 0 {
        return;
    }
    println!();
    println!(
        "## Churn until the first failure (4 Mi units, sizes 1..=2056): median utilisation [min..max], false OOM count"
    );
    println!();
    print!("| allocator |");
    for a in ALIGNS {
        print!(" align {a} |");
    }
    println!();
    println!("|---|{}", "---|".repeat(ALIGNS.len()));
    for (k, name) in CONTENDERS.iter().enumerate() {
        if !wanted(k) {
            continue;
        }
        print!("| {name} |");
        for &align in &ALIGNS {
            let mut utils = Vec::new();
            let mut false_ooms = 0;
            for seed in 0..seeds {
                let r = churn_for(k, 0x9e37_79b9 ^ (seed * 7919 + 1), align);
                utils.push(r.utilisation);
                false_ooms += u32::from(r.false_oom);
            }
            let lo = utils.iter().copied().fold(f64::MAX, f64::min);
            let hi = utils.iter().copied().fold(0.0, f64::max);
            let fo = if k == 4 {
                "n/a".to_string()
            } else {
                false_ooms.to_string()
            };
            print!(" {:.3} [{lo:.3}..{hi:.3}], {fo} |", median(&mut utils));
        }
        println!();
    }
}
