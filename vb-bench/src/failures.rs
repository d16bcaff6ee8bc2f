//! How long a failing allocation takes on a full or fragmented block.
//!
//! Engines try block after block until one fits, so a slow failure is a frame hitch. Each
//! mode is built with `n` live allocations, then the same failing request is timed one call at
//! a time: the first call, then the median and 99th percentile of the calls after it (the
//! maximum is a preemption on a shared machine more often than not).
//!
//! - ring: a linear block used as a ring buffer that has wrapped and is full;
//! - stack: a linear block filled from the bottom;
//! - double stack: a linear block filled half from each end;
//! - TLSF holes: `n / 2` holes of 509 units, each starting 2 units past a multiple of 512,
//!   between `n` allocations; a request of 256 units aligned to 256 fits in none of them
//!   (it needs 510), although each is larger than the request.

use std::hint::black_box;
use std::time::Instant;

use tagalloc::virtual_block::{Alloc, Request, Strategy, VirtualBlock};

use crate::median;

/// Per-call times in nanoseconds: the first call, then the median and 99th percentile of the
/// rest, and the mean over a batch of back-to-back calls (below the clock's resolution for a
/// single call).
struct Times {
    first: f64,
    median: f64,
    p99: f64,
    batch: f64,
    calls: usize,
}

/// Times `fail` (which must fail) once, then again until about 0.2 s have passed (5 to 1000
/// calls).
fn time_failures(mut fail: impl FnMut() -> bool) -> Times {
    let t = Instant::now();
    let failed = black_box(fail());
    let first = t.elapsed().as_nanos() as f64;
    assert!(failed, "the request was meant to fail");
    let calls = ((2e8 / first.max(1.0)) as usize).clamp(5, 1000);
    let mut rest: Vec<f64> = (0..calls)
        .map(|_| {
            let t = Instant::now();
            black_box(fail());
            t.elapsed().as_nanos() as f64
        })
        .collect();
    let median = median(&mut rest);
    let p99 = rest[(rest.len() * 99).div_ceil(100) - 1];
    let t = Instant::now();
    for _ in 0..calls {
        black_box(fail());
    }
    let batch = t.elapsed().as_nanos() as f64 / calls as f64;
    Times {
        first,
        median,
        p99,
        batch,
        calls,
    }
}

fn row(mode: &str, n: usize, t: &Times) {
    println!(
        "| {mode} | {n} | {:.2} | {:.3} | {:.2} | {:.4} | {} |",
        t.first / 1e3,
        t.median / 1e3,
        t.p99 / 1e3,
        t.batch / 1e3,
        t.calls
    );
}

const UNIT: u64 = 64;

fn stack(n: usize) -> VirtualBlock<()> {
    let mut b = VirtualBlock::new_linear(n as u64 * UNIT);
    for _ in 0..n {
        b.allocate(&Request::new(UNIT), ()).expect("fits");
    }
    b
}

fn ring(n: usize) -> VirtualBlock<()> {
    let mut b = VirtualBlock::new_linear(n as u64 * UNIT);
    let mut live: std::collections::VecDeque<Alloc> = (0..n)
        .map(|_| b.allocate(&Request::new(UNIT), ()).expect("fits"))
        .collect();
    for _ in 0..n / 2 {
        b.free(live.pop_front().expect("live")).expect("live");
    }
    for _ in 0..n / 2 {
        live.push_back(b.allocate(&Request::new(UNIT), ()).expect("wraps"));
    }
    b
}

fn double_stack(n: usize) -> VirtualBlock<()> {
    let mut b = VirtualBlock::new_linear(n as u64 * UNIT);
    for i in 0..n {
        let r = Request::new(UNIT);
        let r = if i % 2 == 0 { r } else { r.upper_address() };
        b.allocate(&r, ()).expect("fits");
    }
    b
}

/// Hole layout: per 512 units, [2 used][509 free][1 used].
const GROUP: u64 = 512;

fn tlsf_holes(n: usize) -> VirtualBlock<()> {
    let groups = n as u64 / 2;
    let mut b = VirtualBlock::new(groups * GROUP);
    let mut holes = Vec::new();
    for _ in 0..groups {
        b.allocate(&Request::new(2), ()).expect("fits");
        holes.push(b.allocate(&Request::new(509), ()).expect("fits"));
        b.allocate(&Request::new(1), ()).expect("fits");
    }
    for h in holes {
        b.free(h).expect("live");
    }
    b
}

fn offset_allocator_holes(n: usize) -> offset_allocator::Allocator {
    let groups = n as u32 / 2;
    // It rounds sizes up to its bins (509 takes 512), so it gets room to spare, filled below.
    let mut a = offset_allocator::Allocator::with_max_allocs(groups * 520, 1 << 20);
    let mut holes = Vec::new();
    for _ in 0..groups {
        a.allocate(2).expect("fits");
        holes.push(a.allocate(509).expect("fits"));
        a.allocate(1).expect("fits");
    }
    while a.allocate(511).is_some() {}
    for h in holes {
        a.free(h);
    }
    a
}

pub fn failures_section() {
    println!();
    println!(
        "## A failing allocation (µs per call: the first, then the median and 99th percentile of the calls after it, timed one by one, and their mean timed as a batch)"
    );
    println!();
    println!("| mode | live allocations | first | median | p99 | batch mean | calls |");
    println!("|---|---:|---:|---:|---:|---:|---:|");
    let fail = |b: &mut VirtualBlock<()>, r: Request<'static>| b.allocate(&r, ()).is_err();
    for n in [1_000, 10_000, 100_000] {
        let mut b = ring(n);
        row(
            "ring",
            n,
            &time_failures(|| fail(&mut b, Request::new(UNIT))),
        );
        let mut b = stack(n);
        row(
            "stack",
            n,
            &time_failures(|| fail(&mut b, Request::new(UNIT))),
        );
        let mut b = double_stack(n);
        row(
            "double stack, lower",
            n,
            &time_failures(|| fail(&mut b, Request::new(UNIT))),
        );
        row(
            "double stack, upper",
            n,
            &time_failures(|| fail(&mut b, Request::new(UNIT).upper_address())),
        );
        for strategy in [
            Strategy::Balanced,
            Strategy::MinTime,
            Strategy::MinMemory,
            Strategy::MinOffset,
        ] {
            let mut b = tlsf_holes(n);
            let r = Request::new(256).align(256).strategy(strategy);
            row(
                &format!("TLSF {strategy:?}, {} holes", n / 2),
                n,
                &time_failures(|| fail(&mut b, r)),
            );
        }
        // For reference: offset-allocator, asked for 256 + 255 units (its alignment emulation).
        let mut a = offset_allocator_holes(n);
        row(
            &format!("offset-allocator, {} holes", n / 2),
            n,
            &time_failures(|| a.allocate(511).is_none()),
        );
    }
}
