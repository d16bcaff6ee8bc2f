//! What records and budgets cost, with tagalloc as the global allocator, one process per
//! measurement (records and budgets change process-wide state). Prints ns per operation;
//! run it under `valgrind --tool=callgrind` for instruction counts. `compare/records_cost.sh`
//! runs every case side by side.
//!
//! ```text
//! cargo run --release --example records_cost -- <workload> <mode> [operations]
//! ```
//! Workloads:
//! - `child-pairs`: alloc+free pairs of a 64-byte `Box::new_in(.., Loader)`, `Loader` a child
//!   of the SystemAllocator whose records or budget the mode sets;
//! - `churn-256`, `churn-100000`: that many live objects of 16-256 B through the global
//!   allocator, random ones replaced; the mode sets the SystemAllocator's records.
//!
//! Modes: `off`, `sample` (512 KiB), `basic`, `full` (8 frames), `warn` and `fail` (a budget
//! the workload never reaches; child pairs only).

use allocator_api2::boxed::Box as ABox;
use std::hint::black_box;
use std::time::Instant;
use tagalloc::{BudgetMode, RecordMode, SystemAllocator};

#[global_allocator]
static GLOBAL: SystemAllocator = SystemAllocator::new();

tagalloc::allocator!(Loader: child of SystemAllocator, "the measured child");

fn mode_of(name: &str) -> Option<RecordMode> {
    Some(match name {
        "off" => RecordMode::Off,
        "sample" => RecordMode::sample(),
        "basic" => RecordMode::Basic,
        "full" => RecordMode::Full { frames: 8 },
        _ => return None,
    })
}

#[inline(never)]
fn child_pairs(n: u64) -> u64 {
    let mut sum = 0u64;
    for i in 0..n {
        let b = ABox::new_in([i as u8; 64], Loader);
        sum += u64::from(black_box(b)[0]);
    }
    sum
}

/// A small xorshift generator, so every run does the same work.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

#[inline(never)]
fn churn(live: usize, n: u64) -> u64 {
    let mut rng = Rng(0x5EED);
    let mut slots: Vec<Box<[u8]>> = (0..live)
        .map(|i| vec![i as u8; 16 + (rng.next() % 241) as usize].into_boxed_slice())
        .collect();
    let mut sum = 0u64;
    for i in 0..n {
        let k = (rng.next() % live as u64) as usize;
        let fresh = vec![i as u8; 16 + (rng.next() % 241) as usize].into_boxed_slice();
        sum += u64::from(std::mem::replace(&mut slots[k], fresh)[0]);
    }
    sum + slots.len() as u64
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let usage = "usage: records_cost <child-pairs|churn-256|churn-100000> \
                 <off|sample|basic|full|warn|fail> [operations]";
    let (workload, mode) = match &args[..] {
        [w, m] | [w, m, _] => (w.as_str(), m.as_str()),
        _ => {
            eprintln!("{usage}");
            std::process::exit(2);
        }
    };
    let n: u64 = args
        .get(2)
        .map_or(1_000_000, |s| s.parse().expect("a number"));
    let run: Box<dyn Fn() -> u64> = match workload {
        "child-pairs" => {
            match (mode, mode_of(mode)) {
                (_, Some(m)) => Loader.set_records(m),
                ("warn", _) => Loader.set_budget(Some(1 << 40), BudgetMode::Warn),
                ("fail", _) => Loader.set_budget(Some(1 << 40), BudgetMode::Fail),
                _ => {
                    eprintln!("{usage}");
                    std::process::exit(2);
                }
            }
            child_pairs(100_000); // warm-up, the same whatever `n` is
            Box::new(move || child_pairs(n))
        }
        w if w.starts_with("churn-") => {
            let live: usize = w["churn-".len()..].parse().expect("churn-<live objects>");
            let Some(m) = mode_of(mode) else {
                eprintln!("{usage}");
                std::process::exit(2);
            };
            GLOBAL.set_records(m);
            Box::new(move || churn(live, n))
        }
        _ => {
            eprintln!("{usage}");
            std::process::exit(2);
        }
    };
    let start = Instant::now();
    black_box(run());
    let ns = start.elapsed().as_nanos() as f64 / n as f64;
    println!("{workload} {mode}: {ns:.2} ns per operation");
}
