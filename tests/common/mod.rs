//! Helpers shared by test binaries (each `tests/*.rs` that needs one says `mod common;`).
// Each binary uses some of the helpers, not all.
#![allow(dead_code)]

pub mod messages;
pub mod pprof;
pub mod viewers;

use std::process::Command;
use tagalloc::records;

/// Re-runs this test binary's `child_entry_point` test with `var=case` in the environment,
/// asserts that the child did not exit cleanly (misuse must abort), and returns its stderr.
pub fn run_aborting_child(var: &str, case: &str) -> String {
    run_aborting_child_with(var, case, &[])
}

/// [`run_aborting_child`] with more variables in the child's environment.
pub fn run_aborting_child_with(var: &str, case: &str, env: &[(&str, &str)]) -> String {
    let exe = std::env::current_exe().unwrap();
    let out = Command::new(exe)
        .args([
            "child_entry_point",
            "--exact",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(var, case)
        .envs(env.iter().copied())
        .output()
        .unwrap();
    assert!(!out.status.success(), "case {case} should have aborted");
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// The `SystemAllocator`'s sampled records of `requested`-byte requests, from a fresh
/// records snapshot: (how many, the blocks they estimate). Asserts they are all samples.
pub fn sampled_records_of_size(requested: usize) -> (usize, f64) {
    let snapshot = records::snapshot();
    let ours: Vec<_> = snapshot
        .records_of("SystemAllocator")
        .filter(|r| r.requested == requested)
        .collect();
    assert!(ours.iter().all(|r| r.sampled));
    (ours.len(), ours.iter().map(|r| r.weight).sum())
}

/// How many cases a proptest model test runs: `PROPTEST_CASES` from the environment when set
/// (the stress script, `stress/run.sh`, raises it), else the test's own `default`, which keeps
/// the README's test command short. (`ProptestConfig::with_cases` alone would ignore the
/// variable.)
pub fn model_cases(default: u32) -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|cases| cases.parse().ok())
        .unwrap_or(default)
}
