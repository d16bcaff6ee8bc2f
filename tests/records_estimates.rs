//! Sampled estimates with the real allocator: 200 MiB of traffic through the global
//! `SystemAllocator` sampling at the default 512 KiB, with a fixed seed; the weighted
//! samples must estimate the bytes and blocks allocated. The bound has a margin of three
//! standard deviations: at this interval and traffic one standard deviation is about 5% of
//! the bytes and 11% of the blocks (see `records::sample` and docs/records.md).
//!
//! One test: the records are process-wide. `TAGALLOC_ESTIMATE_SEEDS=50 cargo test --release
//! --test records_estimates -- --nocapture` runs 50 seeds and prints each error and their
//! spread (the figures in docs/records.md).

use std::alloc::{GlobalAlloc, Layout};
use std::ptr::NonNull;
use tagalloc::SystemAllocator;
use tagalloc::records::{self, RecordMode};

#[global_allocator]
static GLOBAL: SystemAllocator = SystemAllocator::new();

const TRAFFIC: usize = 200 << 20;
const INTERVAL: u64 = 512 * 1024;

/// A small xorshift generator for the sizes (the same traffic in every run).
struct Sizes(u64);

impl Sizes {
    /// Mostly 16 B to 4 KiB, one block in 20 of 4 to 64 KiB.
    fn next(&mut self) -> usize {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        let r = self.0;
        if r % 20 == 0 {
            4096 + (r >> 8) as usize % (60 << 10)
        } else {
            16 + (r >> 8) as usize % 4081
        }
    }
}

/// Allocates `TRAFFIC` bytes through the global allocator, keeping the last 256 blocks
/// live; returns the granted bytes and the blocks allocated.
fn churn() -> (f64, f64) {
    let mut sizes = Sizes(0x2024);
    let mut live: Vec<(NonNull<u8>, Layout)> = Vec::with_capacity(256);
    let (mut requested, mut granted, mut blocks) = (0, 0, 0);
    while requested < TRAFFIC {
        let layout = Layout::from_size_align(sizes.next(), 8).unwrap();
        // SAFETY: a non-zero size; freed below with the same layout.
        let p = NonNull::new(unsafe { GLOBAL.alloc(layout) }).expect("memory");
        // SAFETY: `p` is live, allocated with `layout`.
        granted += unsafe { GLOBAL.usable_size(p, layout) };
        requested += layout.size();
        blocks += 1;
        if live.len() == 256 {
            let (q, l) = live.swap_remove(blocks % 256);
            // SAFETY: allocated above with `l`, freed once.
            unsafe { GLOBAL.dealloc(q.as_ptr(), l) };
        }
        live.push((p, layout));
    }
    for (q, l) in live {
        // SAFETY: as above.
        unsafe { GLOBAL.dealloc(q.as_ptr(), l) };
    }
    (granted as f64, blocks as f64)
}

/// The `SystemAllocator`'s estimated bytes and blocks allocated so far.
fn estimated() -> (f64, f64) {
    let snapshot = records::snapshot();
    snapshot
        .sites
        .iter()
        .filter(|s| s.allocator == "SystemAllocator")
        .fold((0.0, 0.0), |(b, n), s| {
            (b + s.total_bytes, n + s.total_blocks)
        })
}

/// One run on a fresh thread (a fresh generator, seeded from `seed`): the relative errors
/// of the bytes and the blocks.
fn run(seed: u64) -> (f64, f64) {
    records::set_sample_seed(Some(seed));
    std::thread::spawn(|| {
        let before = estimated();
        let truth = churn();
        let after = estimated();
        (
            (after.0 - before.0) / truth.0 - 1.0,
            (after.1 - before.1) / truth.1 - 1.0,
        )
    })
    .join()
    .unwrap()
}

#[test]
fn sampled_totals_of_200_mib_estimate_the_traffic() {
    GLOBAL.set_records(RecordMode::Sample {
        interval: INTERVAL,
        frames: 0,
    });
    let (bytes, blocks) = run(1);
    assert!(bytes.abs() < 0.15, "bytes off by {:+.1}%", 100.0 * bytes);
    assert!(blocks.abs() < 0.35, "blocks off by {:+.1}%", 100.0 * blocks);

    if let Ok(seeds) = std::env::var("TAGALLOC_ESTIMATE_SEEDS") {
        let seeds: u64 = seeds.parse().unwrap();
        let errors: Vec<(f64, f64)> = (1..=seeds).map(run).collect();
        let spread = |f: fn(&(f64, f64)) -> f64| {
            let n = errors.len() as f64;
            let mean = errors.iter().map(f).sum::<f64>() / n;
            let sd = (errors.iter().map(|e| (f(e) - mean).powi(2)).sum::<f64>() / (n - 1.0)).sqrt();
            let within = errors.iter().filter(|e| f(e).abs() < 0.05).count();
            let worst = errors.iter().map(|e| f(e).abs()).fold(0.0, f64::max);
            (mean, sd, within, worst)
        };
        for (what, f) in [
            ("bytes", (|e: &(f64, f64)| e.0) as fn(&_) -> _),
            ("blocks", |e| e.1),
        ] {
            let (mean, sd, within, worst) = spread(f);
            println!(
                "{what}: {seeds} seeds, mean error {:+.2}%, sd {:.2}%, worst {:.2}%, \
                 {within} of {seeds} within 5%",
                100.0 * mean,
                100.0 * sd,
                100.0 * worst
            );
        }
    }
    GLOBAL.set_records(RecordMode::Off);
}
