//! Runs one workload under this build's global allocator and prints one result line.
//!
//! Usage: `workload-<alloc> <name> [--scale F]`, or `workload-<alloc> --list`.
//!
//! The result line is what the `compare` driver parses:
//! `RESULT workload=<name> alloc=<alloc> ms=<wall ms> cpu_ms=<user+sys ms> peak_kib=<VmHWM> end_kib=<VmRSS>
//! trim_kib=<VmRSS> trimmed=<0|1> check=<checksum>`, where `end_kib` is read after the
//! workload freed everything and a short sleep, and `trim_kib` after the allocator's trim hook
//! (if it has one) and another short sleep. The time covers the workload only, not process
//! start-up nor the RSS readings.

use std::process::ExitCode;
use std::time::{Duration, Instant};

use compare::{allocator, rss, workloads};

/// Long enough for an allocator with a purge thread or a short purge delay to act, short
/// enough not to dominate a run.
const SETTLE: Duration = Duration::from_millis(50);

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().map(String::as_str) == Some("--list") {
        for w in workloads::ALL {
            println!("{:<12} {}", w.name, w.about);
        }
        return ExitCode::SUCCESS;
    }
    if allocator::NAME == "none" {
        eprintln!(
            "workload: built without an alloc-* feature; build it with one (see compare/README.md)"
        );
        return ExitCode::FAILURE;
    }
    let Some(workload) = args.first().and_then(|n| workloads::find(n)) else {
        eprintln!("usage: workload <name> [--scale F] | --list");
        return ExitCode::FAILURE;
    };
    let scale = match args.get(1).map(String::as_str) {
        None => 1.0,
        Some("--scale") => match args.get(2).and_then(|s| s.parse::<f64>().ok()) {
            Some(s) if s > 0.0 => s,
            _ => {
                eprintln!("--scale needs a positive number");
                return ExitCode::FAILURE;
            }
        },
        Some(other) => {
            eprintln!("unexpected argument {other:?}");
            return ExitCode::FAILURE;
        }
    };
    if !allocator::NOTE.is_empty() {
        eprintln!("warning: {}", allocator::NOTE);
    }

    let cpu_start = rss::cpu_ms();
    let start = Instant::now();
    let check = allocator::in_thread(|| (workload.run)(scale));
    let elapsed = start.elapsed();
    let cpu = rss::cpu_ms() - cpu_start;

    std::thread::sleep(SETTLE);
    let end = rss::read().unwrap_or_default();
    let trimmed = allocator::trim();
    if trimmed {
        std::thread::sleep(SETTLE);
    }
    let after_trim = rss::read().unwrap_or_default();

    println!(
        "RESULT workload={} alloc={} ms={:.3} cpu_ms={:.3} peak_kib={} end_kib={} trim_kib={} trimmed={} check={}",
        workload.name,
        allocator::NAME,
        elapsed.as_secs_f64() * 1e3,
        cpu,
        after_trim.peak_kib,
        end.current_kib,
        after_trim.current_kib,
        u8::from(trimmed),
        check
    );
    ExitCode::SUCCESS
}
