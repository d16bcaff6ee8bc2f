//! Small alloc+free pairs through the global allocator (a 32-byte `Vec`, its size hidden
//! from the compiler), in one process per mode, printing ns of CPU time per pair: what a scoped
//! tag costs.
//! `compare/scope_overhead.sh` runs the modes side by side, interleaved.
//!
//! ```text
//! cargo run --release --example scope_pairs -- <mode> <pairs>
//! ```
//! Modes:
//! - `untagged`: no tag is ever entered in the process (the fast paths of a program that
//!   does not use scoped tags);
//! - `tags-on`: a tag was entered once, the pairs run outside any scope (every free asks its
//!   block for its tag);
//! - `scoped`: the pairs run inside a tag with a lane built into the thread caches;
//! - `scoped-far`: inside a tag past those, whose lane is made on demand;
//! - `enter`: entering and leaving a scope whose lane the thread has set up (the scope
//!   allocated before), per pair of calls.

use std::hint::black_box;
use tagalloc::SystemAllocator;

#[global_allocator]
static GLOBAL: SystemAllocator = SystemAllocator::new();

tagalloc::allocator!(Near: child of SystemAllocator, "a tag with a built-in lane");
tagalloc::allocator!(F1: child of SystemAllocator, "filler");
tagalloc::allocator!(F2: child of SystemAllocator, "filler");
tagalloc::allocator!(F3: child of SystemAllocator, "filler");
tagalloc::allocator!(F4: child of SystemAllocator, "filler");
tagalloc::allocator!(F5: child of SystemAllocator, "filler");
tagalloc::allocator!(F6: child of SystemAllocator, "filler");
tagalloc::allocator!(F7: child of SystemAllocator, "filler");
tagalloc::allocator!(Far: child of SystemAllocator, "a tag past the built-in lanes");

#[inline(never)]
fn pairs(n: u64) -> u64 {
    let mut sum = 0u64;
    for i in 0..n {
        let mut v: Vec<u8> = Vec::with_capacity(black_box(32));
        v.push(i as u8);
        sum += u64::from(black_box(v)[0]);
    }
    sum
}

/// The calling thread's CPU time in ns: unlike the wall clock it does not count the time
/// another process on a shared machine holds the CPU.
fn thread_cpu_ns() -> u128 {
    let mut t = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `t` is a valid timespec for the call to fill.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut t) };
    assert_eq!(rc, 0, "clock_gettime(CLOCK_THREAD_CPUTIME_ID)");
    t.tv_sec as u128 * 1_000_000_000 + t.tv_nsec as u128
}

/// ns of the thread's CPU time per pair of `f`'s `n` pairs.
fn timed(n: u64, f: impl FnOnce() -> u64) -> f64 {
    let start = thread_cpu_ns();
    black_box(f());
    (thread_cpu_ns() - start) as f64 / n as f64
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (mode, n) = match &args[..] {
        [mode, n] => (mode.as_str(), n.parse::<u64>().expect("a number of pairs")),
        _ => {
            eprintln!("usage: scope_pairs <untagged|tags-on|scoped|scoped-far|enter> <pairs>");
            std::process::exit(2);
        }
    };
    // Tags claimed in a fixed order: Near first (a built-in lane), Far ninth (made on demand).
    let claim_all = || {
        for enter in [
            || Near.enter(),
            || F1.enter(),
            || F2.enter(),
            || F3.enter(),
            || F4.enter(),
            || F5.enter(),
            || F6.enter(),
            || F7.enter(),
            || Far.enter(),
        ] {
            drop(enter());
        }
    };
    let warm = n / 10;
    let ns = match mode {
        "untagged" => {
            pairs(warm);
            timed(n, || pairs(n))
        }
        "tags-on" => {
            claim_all();
            pairs(warm);
            timed(n, || pairs(n))
        }
        "scoped" | "scoped-far" => {
            claim_all();
            let _tag = if mode == "scoped" {
                Near.enter()
            } else {
                Far.enter()
            };
            pairs(warm);
            timed(n, || pairs(n))
        }
        "enter" => {
            claim_all();
            // As in a program whose scopes allocate: the thread's lane of the tag is set up
            // by its first allocation inside the scope, before the timed loop.
            {
                let _tag = Near.enter();
                pairs(1);
            }
            timed(n, || {
                for _ in 0..n {
                    drop(black_box(Near.enter()));
                }
                n
            })
        }
        other => {
            eprintln!("unknown mode {other}");
            std::process::exit(2);
        }
    };
    println!("{mode}: {ns:.3} ns per pair");
}
