//! Benchmarks tagalloc's virtual block against `offset-allocator`, `rlsf` and `range-alloc`.
//!
//! Every contender in the same run, interleaved and repeated, medians reported:
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
//! 3. **GPU heap** ([`gpu_workload`]): about 800,000 operations of a renderer's frames; ns
//!    per operation, then failures and false out-of-memory in a heap too tight for it.
//! 4. **Failures**: how long a failing allocation takes with 1,000 to 100,000 live
//!    allocations in every linear mode and on a TLSF block full of holes that miss the
//!    alignment (tagalloc; offset-allocator for reference).
//!
//! Times are this thread's CPU time ([`clock`]): on a shared machine the wall clock also
//! counts other processes. Fairness: the same pre-generated random sequence for everyone; offset-allocator has no
//! alignment, so it is asked for `size + align - 1` and the offset rounded up (as its issue #3
//! suggests); rlsf keeps headers inside the managed memory, so it works on a real,
//! pre-faulted buffer and its false-OOM count is not defined.
//!
//! Usage: `cargo run --release -p vb-bench -- [replica] [churn] [gpu] [failures]
//! [--reps N] [--seeds N] [--frames N] [--timing-only]` (no section name: all of them;
//! `--timing-only` skips the GPU workload's false-OOM check). `VB_ONLY=0,3` runs
//! only those rows (see [`contenders::CONTENDERS`]), for profiling.

mod clock;
mod contenders;
mod failures;
mod gpu;
mod gpu_workload;
mod replica;

/// xorshift64*: the same sequence for every contender.
pub struct Rng(pub u64);

impl Rng {
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
}

pub fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n == 0 {
        f64::NAN
    } else if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
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
    let mut sections: Vec<String> = Vec::new();
    let (mut reps, mut seeds, mut frames, mut judge) = (7usize, 20u64, None, true);
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut value = || -> u64 {
            args.next()
                .and_then(|v| v.parse().ok())
                .unwrap_or_else(|| panic!("{a} needs a number"))
        };
        match a.as_str() {
            "--reps" => reps = value() as usize,
            "--seeds" => seeds = value(),
            "--frames" => frames = Some(value() as u32),
            "--timing-only" => judge = false,
            "replica" | "churn" | "gpu" | "failures" => sections.push(a),
            _ => panic!("unknown argument {a}"),
        }
    }
    let run = |s: &str| sections.is_empty() || sections.iter().any(|x| x == s);
    // VB_ONLY=<rows, e.g. 0,3> runs just those contenders (for profiling).
    let only: Option<Vec<usize>> = std::env::var("VB_ONLY")
        .ok()
        .map(|v| v.split(',').filter_map(|k| k.trim().parse().ok()).collect());
    let wanted = |k: usize| only.as_ref().is_none_or(|o| o.contains(&k));
    contenders::check_labels();
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    println!("# Virtual block benchmark");
    println!();
    println!(
        "{} ({threads} threads), {reps} repetitions (medians), {seeds} churn seeds.",
        cpu_model()
    );
    if run("replica") {
        replica::replica_section(reps, &wanted);
    }
    if run("churn") && seeds > 0 {
        replica::churn_section(seeds, &wanted);
    }
    if run("gpu") {
        gpu::gpu_section(reps, frames, judge, &wanted);
    }
    if run("failures") {
        failures::failures_section();
    }
}
