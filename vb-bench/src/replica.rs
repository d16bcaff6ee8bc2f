//! VMA's virtual-block benchmark replica and the churn-to-first-failure quality test.

use std::collections::BTreeMap;
use std::hint::black_box;

use crate::clock::thread_cpu_ns;
use crate::contenders::{CONTENDERS, Contender, RLSF, with_contender};
use crate::{Rng, median};

const MAX_SIZE: u64 = 2056;
const FIRST_ALLOCS: usize = 7200;
const RANDOM_OPS: usize = 14_400;
pub const ALIGNS: [u64; 4] = [1, 16, 64, 256];

/// The pre-generated VMA replica workload.
pub struct Replica {
    first_sizes: Vec<u64>,
    /// Random ops: (allocate?, size or index seed).
    ops: Vec<(bool, u64)>,
    capacity: u64,
}

impl Replica {
    pub fn new(seed: u64) -> Self {
        let mut rng = Rng(seed);
        let first_sizes: Vec<u64> = (0..FIRST_ALLOCS)
            .map(|_| rng.next_u64() % MAX_SIZE + 1)
            .collect();
        let ops = (0..RANDOM_OPS)
            .map(|_| {
                let alloc = rng.next_u64() % 2 == 0;
                (
                    alloc,
                    if alloc {
                        rng.next_u64() % MAX_SIZE + 1
                    } else {
                        rng.next_u64()
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
pub struct ReplicaResult {
    alloc: f64,
    random: f64,
    free: f64,
    /// Allocations left for the free phase.
    remaining: usize,
    failures: u64,
    /// Operations in the runs behind this result.
    operations: usize,
}

#[inline(never)]
fn run_replica<C: Contender>(c: &mut C, w: &Replica, align: u64) -> ReplicaResult {
    let mut live: Vec<C::Handle> = Vec::with_capacity(FIRST_ALLOCS * 2);
    let mut failures = 0;
    let t0 = thread_cpu_ns();
    for &s in &w.first_sizes {
        match c.alloc(s, align) {
            Some((h, off, _)) => {
                black_box(off);
                live.push(h);
            }
            None => failures += 1,
        }
    }
    let t1 = thread_cpu_ns();
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
    let t2 = thread_cpu_ns();
    let remaining = live.len();
    for h in live.drain(..) {
        c.free(h);
    }
    let t3 = thread_cpu_ns();
    let ns = |a: u64, b: u64, n: usize| (b - a) as f64 / n.max(1) as f64;
    ReplicaResult {
        alloc: ns(t0, t1, FIRST_ALLOCS),
        random: ns(t1, t2, RANDOM_OPS),
        free: ns(t2, t3, remaining),
        remaining,
        failures,
        operations: FIRST_ALLOCS + RANDOM_OPS + remaining,
    }
}

/// Runs the replica twice on one instance and keeps the second run: every run ends with
/// everything freed, so the second run sees warmed-up metadata (no first-touch page faults),
/// the steady state a long-lived block lives in.
fn warm<C: Contender>(c: &mut C, w: &Replica, align: u64) -> ReplicaResult {
    let first = run_replica(c, w, align);
    let mut second = run_replica(c, w, align);
    second.failures = second.failures.max(first.failures);
    second.operations += first.operations;
    second
}

/// The replica table: every wanted contender at every alignment, `reps` interleaved rounds.
pub fn replica_section(reps: usize, wanted: &dyn Fn(usize) -> bool) {
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
    // VB_ALIGNS=<alignments, e.g. 1,256> runs just those (for callgrind.sh).
    let aligns: Option<Vec<u64>> = std::env::var("VB_ALIGNS")
        .ok()
        .map(|v| v.split(',').filter_map(|a| a.trim().parse().ok()).collect());
    let mut operations = 0;
    // samples[k][align] = repetitions
    let mut samples: Vec<Vec<Vec<ReplicaResult>>> =
        vec![vec![Vec::new(); ALIGNS.len()]; CONTENDERS.len()];
    for rep in 0..reps {
        for (ai, &align) in ALIGNS.iter().enumerate() {
            if aligns.as_ref().is_some_and(|a| !a.contains(&align)) {
                continue;
            }
            // Rotate the order each repetition so no contender always runs first.
            for j in 0..CONTENDERS.len() {
                let k = (j + rep) % CONTENDERS.len();
                if wanted(k) {
                    let r = with_contender!(k, w.capacity, |c| warm(&mut c, &w, align));
                    operations += r.operations;
                    samples[k][ai].push(r);
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
    if aligns.is_some() {
        println!();
        println!("operations timed: {operations} (both runs of each warmed-up measurement)");
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
        if !live.is_empty() && rng.next_u64() % 3 == 0 {
            let i = (rng.next_u64() % live.len() as u64) as usize;
            let (h, size, range) = live.swap_remove(i);
            c.free(h);
            held.remove(&range.0);
            live_bytes -= size;
            continue;
        }
        let size = rng.next_u64() % MAX_SIZE + 1;
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

/// Whether a gap between held ranges (start → length) can hold `size` at `align`.
pub fn fits_in_gaps(held: &BTreeMap<u64, u64>, capacity: u64, size: u64, align: u64) -> bool {
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

/// The churn table: utilisation at the first failure and false out-of-memory counts.
pub fn churn_section(seeds: u64, wanted: &dyn Fn(usize) -> bool) {
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
                let seed = 0x9e37_79b9 ^ (seed * 7919 + 1);
                let r = with_contender!(k, CHURN_CAPACITY, |c| run_churn(&mut c, seed, align));
                utils.push(r.utilisation);
                false_ooms += u32::from(r.false_oom);
            }
            let lo = utils.iter().copied().fold(f64::MAX, f64::min);
            let hi = utils.iter().copied().fold(0.0, f64::max);
            let fo = if k == RLSF {
                "n/a".to_string()
            } else {
                false_ooms.to_string()
            };
            print!(" {:.3} [{lo:.3}..{hi:.3}], {fo} |", median(&mut utils));
        }
        println!();
    }
}
