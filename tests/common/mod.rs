//! Helpers shared by test binaries (each `tests/*.rs` that needs one says `mod common;`).

use std::process::Command;

/// Re-runs this test binary's `child_entry_point` test with `var=case` in the environment,
/// asserts that the child did not exit cleanly (misuse must abort), and returns its stderr.
pub fn run_aborting_child(var: &str, case: &str) -> String {
    let exe = std::env::current_exe().unwrap();
    let out = Command::new(exe)
        .args([
            "child_entry_point",
            "--exact",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(var, case)
        .output()
        .unwrap();
    assert!(!out.status.success(), "case {case} should have aborted");
    String::from_utf8_lossy(&out.stderr).into_owned()
}
