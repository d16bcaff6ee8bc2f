//! The GPU-heap workload ([`crate::gpu_workload`]) timed per contender, and checked for false
//! out-of-memory.

use std::collections::BTreeMap;
use std::hint::black_box;

use crate::clock::thread_cpu_ns;
use crate::contenders::{CONTENDERS, Contender, RANGE_ALLOC, RLSF, with_contender};
use crate::gpu_workload::{FRAMES, GpuWorkload, HEAP, Op, gpu_heap};
use crate::median;
use crate::replica::fits_in_gaps;

/// A heap the workload does not fit in at every moment, so that allocations fail and each
/// failure can be judged.
const TIGHT_HEAP: u64 = 720 << 20;

/// Plays the sequence; returns the number of failed allocations. This loop is all that is
/// timed (and all that callgrind counts with `--toggle-collect='*gpu*replay*'`).
#[inline(never)]
pub fn replay<C: Contender>(c: &mut C, ops: &[Op], handles: &mut [Option<C::Handle>]) -> u64 {
    let mut failures = 0;
    for op in ops {
        match *op {
            Op::Alloc { slot, size, align } => match c.alloc(size, align) {
                Some((h, offset, _)) => {
                    black_box(offset);
                    handles[slot as usize] = Some(h);
                }
                None => failures += 1,
            },
            Op::Free { slot } => {
                if let Some(h) = handles[slot as usize].take() {
                    c.free(h);
                }
            }
        }
    }
    failures
}

/// Nanoseconds per operation for one run on a fresh contender.
fn timed<C: Contender>(c: &mut C, w: &GpuWorkload) -> (f64, u64) {
    let mut handles = vec![None; w.slots];
    let t = thread_cpu_ns();
    let failures = replay(c, &w.ops, &mut handles);
    let ns = (thread_cpu_ns() - t) as f64 / w.ops.len() as f64;
    (ns, failures)
}

/// Plays the sequence on a block of `capacity` keeping the held ranges; returns failures and
/// false out-of-memory failures (a failure while a gap could hold the request).
fn judged<C: Contender>(c: &mut C, w: &GpuWorkload, capacity: u64) -> (u64, u64) {
    let mut handles: Vec<Option<(C::Handle, u64)>> = vec![None; w.slots];
    let mut held: BTreeMap<u64, u64> = BTreeMap::new();
    let (mut failures, mut false_ooms) = (0, 0);
    for op in &w.ops {
        match *op {
            Op::Alloc { slot, size, align } => match c.alloc(size, align) {
                Some((h, _, range)) => {
                    held.insert(range.0, range.1);
                    handles[slot as usize] = Some((h, range.0));
                }
                None => {
                    failures += 1;
                    false_ooms +=
                        u64::from(c.exact_ranges() && fits_in_gaps(&held, capacity, size, align));
                }
            },
            Op::Free { slot } => {
                if let Some((h, start)) = handles[slot as usize].take() {
                    held.remove(&start);
                    c.free(h);
                }
            }
        }
    }
    (failures, false_ooms)
}

/// The GPU-heap table: ns per operation (median of `reps` interleaved rounds) and ratios to
/// offset-allocator, then failures and false OOMs at the bench heap and at a tight heap.
pub fn gpu_section(reps: usize, frames: Option<u32>, judge: bool, wanted: &dyn Fn(usize) -> bool) {
    let frames = frames.unwrap_or(FRAMES);
    let w = gpu_heap(frames, 0x6f70_7500_d00d);
    println!();
    println!(
        "## GPU heap ({frames} frames, {} operations: 200 transient buffers of 256 B–256 KiB at alignment 256 per frame, \
         384 textures of 64 KiB–8 MiB at 64 KiB with 2% replaced per frame; 1 GiB heap)",
        w.ops.len()
    );
    println!();
    let rows: Vec<usize> = (0..CONTENDERS.len())
        .filter(|&k| k != RANGE_ALLOC && wanted(k))
        .collect();
    let mut samples: Vec<Vec<f64>> = vec![Vec::new(); CONTENDERS.len()];
    let mut failed = vec![0u64; CONTENDERS.len()];
    for rep in 0..reps {
        for j in 0..rows.len() {
            let k = rows[(j + rep) % rows.len()];
            let (ns, failures) = with_contender!(k, HEAP, |c| timed(&mut c, &w));
            samples[k].push(ns);
            failed[k] = failed[k].max(failures);
        }
    }
    let oa = if samples[3].is_empty() {
        f64::NAN
    } else {
        median(&mut samples[3].clone())
    };
    println!(
        "| allocator | ns/op (median of {reps}) | / offset-allocator | failures | failures at {} MiB, false OOM |",
        TIGHT_HEAP >> 20
    );
    println!("|---|---:|---:|---:|---:|");
    for &k in &rows {
        let ns = median(&mut samples[k]);
        let (tight_failures, false_ooms) = if judge {
            with_contender!(k, TIGHT_HEAP, |c| judged(&mut c, &w, TIGHT_HEAP))
        } else {
            (0, 0)
        };
        let fo = if k == RLSF {
            "n/a".to_string()
        } else {
            false_ooms.to_string()
        };
        println!(
            "| {} | {ns:.1} | {:.3} | {} | {tight_failures}, {fo} |",
            CONTENDERS[k],
            ns / oa,
            failed[k]
        );
    }
}
