//! The callgrind micro-benchmark: a fixed number of small allocations and frees, nothing else.
//!
//! Usage: `pairs-<alloc> <pair|batch> <size> <n>`.
//! - `pair`: `n` times allocate `size` bytes and free them at once.
//! - `batch`: `n / 64` times allocate 64 blocks of `size` bytes, then free them in order.
//!
//! A warm-up of the same shape runs first in every case, so thread-cache set-up and the first
//! page of each size class are paid whatever `n` is. `compare callgrind` runs this with `n = 0`
//! and with a large `n` under `valgrind --tool=callgrind` and divides the difference in
//! instructions by `n`: the cost of one alloc+free, free of start-up noise and deterministic.

use std::hint::black_box;
use std::process::ExitCode;

use compare::allocator;

const WARM_UP: usize = 10_000;
const BATCH: usize = 64;

/// Allocates `n` blocks of `size` bytes and frees each right away.
fn pairs(size: usize, n: usize) -> u64 {
    let mut sum = 0u64;
    for i in 0..n {
        let mut v: Vec<u8> = Vec::with_capacity(size);
        v.push(i as u8);
        sum += u64::from(black_box(v)[0]);
    }
    sum
}

/// Allocates blocks of `size` bytes `BATCH` at a time and frees them in allocation order.
fn batches(size: usize, n: usize, held: &mut Vec<Vec<u8>>) -> u64 {
    let mut sum = 0u64;
    for _ in 0..n / BATCH {
        for j in 0..BATCH {
            let mut v: Vec<u8> = Vec::with_capacity(size);
            v.push(j as u8);
            held.push(black_box(v));
        }
        sum += held.iter().map(|v| u64::from(v[0])).sum::<u64>();
        held.clear();
    }
    sum
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let parsed = match args.as_slice() {
        [mode, size, n] => size
            .parse::<usize>()
            .ok()
            .zip(n.parse::<usize>().ok())
            .map(|(s, n)| (mode.as_str(), s, n)),
        _ => None,
    };
    let Some((mode, size, n)) = parsed.filter(|&(_, size, _)| size > 0) else {
        eprintln!("usage: pairs <pair|batch> <size> <n>");
        return ExitCode::FAILURE;
    };
    if allocator::NAME == "none" {
        eprintln!("pairs: built without an alloc-* feature");
        return ExitCode::FAILURE;
    }
    // Allocated before the measured part so its growth is not counted.
    let mut held: Vec<Vec<u8>> = Vec::with_capacity(BATCH);
    let check = match mode {
        "pair" => allocator::in_thread(|| pairs(size, WARM_UP) + pairs(size, n)),
        "batch" => {
            allocator::in_thread(|| batches(size, WARM_UP, &mut held) + batches(size, n, &mut held))
        }
        _ => {
            eprintln!("mode must be pair or batch");
            return ExitCode::FAILURE;
        }
    };
    println!("{} {mode} {size} {n} check={check}", allocator::NAME);
    ExitCode::SUCCESS
}
